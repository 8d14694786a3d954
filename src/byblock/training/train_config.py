"""The recipe of a DFlash / Domino drafter training run: every knob that changes the trained weights.

Written next to the checkpoints (training/dflash_train.py); a resumed run must have the same recipe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainConfig:
    """Recipe of one drafter training run (written next to the checkpoints; a resume must match it)."""

    num_layers: int = 3
    block_size: int = 16
    gamma: float | None = None  # None: the paper's value for the block size
    draft_vocab_size: int = 8192  # 0: the full target vocabulary
    steps: int = 2000
    seqs_per_step: int = 8  # per rank
    anchors_per_seq: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    distill: float = 0.5  # weight of the top-k distillation term (0: hard labels only, as in the paper)
    init_from_target: bool = True
    domino: bool = False  # train a Domino correction head (with the backbone) instead of plain DFlash
    gru_hidden_dim: int = 256
    emb_dim: int = 128  # rank of Domino's logit residual
    lambda_decay: float = 0.5  # base-anchored curriculum: λ goes 1 -> 0 over this fraction of the steps
    freeze_backbone: bool = False  # Domino: train only the head (the DFlash weights stay as they are)
    init_from: str = ""  # a DFlash checkpoint dir to start the backbone from (its vocabulary and mask id too)
    extra_data: str = ""  # comma-separated regen dirs trained on beside the main one (each holds out its own)
    bf16: bool = True  # autocast matmuls to bf16 (weights stay fp32); the CLI defaults to cpu_features.native_bf16()
    val_shards: int = 1  # the last shards are held out for τ
    val_blocks: int = 256
    eval_every: int = 200
    ckpt_every: int = 50
    seed: int = 0
    optimizer: str = "adamw"  # "muon": Muon for the draft layers' matrices, AdamW for the rest (MiMo's recipe)
    sliding_window: int = 0  # > 0: the drafter attends to this many context positions (MiMo's SWA drafter)

    def __post_init__(self) -> None:
        from byblock.errors import InvalidParameterError

        if self.optimizer not in ("adamw", "muon"):
            raise InvalidParameterError(f"--optimizer must be adamw or muon, not '{self.optimizer}'")
        if self.sliding_window < 0 or 0 < self.sliding_window <= self.block_size:
            raise InvalidParameterError("--sliding-window must be 0 (off) or larger than --block-size")


def same_recipe(saved: dict, cfg: TrainConfig) -> bool:
    """Whether a checkpoint's recipe equals cfg; fields added to TrainConfig since it was written must still
    hold their defaults (so an older run resumes under newer byblock)."""
    current, default = asdict(cfg), asdict(TrainConfig())
    return all(current.get(k) == v for k, v in saved.items()) and all(
        current[k] == default[k] for k in current if k not in saved
    )
