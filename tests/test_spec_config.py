"""vLLM's --speculative-config mapped onto byblock's drafters (and drafted-token counting)."""

from __future__ import annotations

import argparse
import json

import pytest
from test_cli import byblock

from byblock.bench.methods import MethodSpec
from byblock.cli import speculative_args
from byblock.drafters import DrafterSpec
from byblock.drafters.spec_config import SpeculativeConfig
from byblock.errors import ByblockError


def test_vllm_forms_map_onto_drafters_counting_drafted_tokens():
    ngram = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert ngram.drafter == "ngram" and ngram.block_size == 8  # 7 drafted + the anchor
    assert ngram.knobs() == {"block_size": 8, "ngram_max": 4, "ngram_min": 2}
    dm = SpeculativeConfig.parse('{"method": "draft_model", "model": "some/id", "num_speculative_tokens": 3}')
    assert dm.drafter == "model:some/id" and DrafterSpec.parse(dm.drafter, **dm.knobs()).block_size == 4
    df = SpeculativeConfig.parse('{"method": "dflash", "num_speculative_tokens": 15, "draft_tensor_parallel_size": 1}')
    assert df.drafter == "dflash" and df.bench_method() == "dflash@16"
    assert MethodSpec.parse(df.bench_method()).drafter.block_size == 16
    tree = SpeculativeConfig.parse('{"method": "hybrid", "tree_budget": 31, "adaptive": true}')
    assert tree.drafter == "adaptive-hybrid" and tree.bench_method() == "adaptive-hybrid@31"
    assert MethodSpec.parse(tree.bench_method()).drafter.adaptive
    assert SpeculativeConfig.parse('{"method": "ddtree", "adaptive": true}').bench_method() == "adaptive-tree"


@pytest.mark.parametrize(
    "text",
    [
        "{nope",
        "[1]",
        '{"method": "eagle3", "model": "x"}',
        '{"method": "magic"}',
        '{"method": "ngram", "num_speculative_tokens": 0}',
        '{"method": "ngram", "num_speculative_tokens": true}',
        '{"method": "ngram", "model": "x"}',
        '{"method": "draft_model"}',
        '{"method": "ngram", "colour": "red"}',
        '{"method": "ngram", "adaptive": true}',
        '{"method": "ddtree", "num_speculative_tokens": 8}',
    ],
)
def test_bad_configs_are_one_line_errors(text):
    with pytest.raises(ByblockError) as e:
        SpeculativeConfig.parse(text)
    assert "\n" not in str(e.value)


def test_serve_and_generate_flag_application():
    args = argparse.Namespace(
        speculative_config='{"method": "dflash", "num_speculative_tokens": 7}',
        drafter=["ngram"],
        block_size=None,
        tree_budget=31,
        num_candidates=1,
    )
    speculative_args.apply_to_serve(args)
    assert args.drafter == ["dflash", "ngram"] and args.block_size == 8
    args = argparse.Namespace(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
        drafter="none",
        block_size=6,
        tree_budget=31,
        num_candidates=1,
        ngram_min=1,
        ngram_max=3,
        adaptive=False,
    )
    with pytest.raises(ByblockError, match="--block-size says 6"):
        speculative_args.apply_to_generate(args)
    args.drafter, args.block_size = "ngram", None
    with pytest.raises(ByblockError, match="not both"):
        speculative_args.apply_to_generate(args)


def test_generate_cli_with_speculative_config_equals_drafter_flags(tiny_llama_dir):
    base = ["generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "24", "--json"]
    via_cfg = byblock(*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}')
    via_flags = byblock(*base, "--drafter", "ngram", "--block-size", "6")
    assert via_cfg.returncode == 0 and via_flags.returncode == 0, via_cfg.stderr + via_flags.stderr
    a, b = json.loads(via_cfg.stdout), json.loads(via_flags.stdout)
    assert a["token_ids"] == b["token_ids"] and a["drafter"] == b["drafter"] and a["block_size"] == b["block_size"] == 6
    bad = byblock(*base, "--speculative-config", '{"method": "eagle3"}')
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
