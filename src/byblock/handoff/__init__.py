"""Handing byblock's drafters to the engines users graduate to: one exporter per engine layout."""
