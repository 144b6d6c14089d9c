"""What one trainer rank (parallel/trainer.py) is built from: one typed record, filled from the config by
runtime/trainer_options.py (RL roles and the SFT job) and per rank by parallel/group.py (rank, rendezvous, CPUs).
No torch import here: the driver builds specs before it imports torch (runtime/roles.py overlaps that with Ray's
start)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerSpec:
    model_path: str
    role: str = "actor"  # actor | ref | critic
    tokenizer_path: str | None = None  # model.tokenizer_path: the tokenizer an export carries (None: model_path's)
    # where this rank runs: its rank, the rendezvous, the CPUs Ray reserved for it (CPU ranks) and its node's ranks
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    shared_port: object = None  # a trainer group's: where rank 0 shares its store's port (launch.py store_port)
    timeout_s: float = 600.0
    cpu_threads: int | None = None
    node_ranks: int | None = None
    # parallelism
    dp_size: int | None = None  # None: world_size
    tp_size: int = 1
    ep_size: int = 1
    cp_size: int = 1
    offload: bool = False  # parallelism.offload=full: FSDP2 keeps params, grads and optimizer state on the host
    optimizer_offload: bool = False  # parallelism.offload=optimizer: fp32 masters + AdamW moments on the host
    packing: bool = False
    share_prompts: bool = False
    defer_grad_sync: bool = False
    # the model
    backend: str = "hf"
    param_dtype: str | None = None  # None: bf16 on a GPU, fp32 on CPU
    master_weights: str = "fsdp"  # fsdp | optimizer (params in param_dtype, fp32 masters in the optimizer)
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool | str = False  # False / True mean none / full
    random_init: bool = False
    config_overrides: dict | None = None
    compile_blocks: bool | None = None  # None: on for the HF dense text trainer on a GPU (LoRA aside)
    fused_head: bool = True
    automodel_options: dict | None = None
    lora: dict | None = None
    seed: int = 42
    full_determinism: bool = False
    # MoE
    routing_replay: bool = False
    gate_precision: str = "float32"
    freeze_moe_router: bool = False
    freeze_visual_encoder: bool = False
    moe_experts_impl: str = "auto"
    aux_loss_coef: float = 0.0
    # the optimizer and its schedule
    lr: float = 1e-6
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    muon: dict | None = None
    lr_scheduler: str = "constant"
    lr_warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.1
    total_steps: int = 1
    max_norm: float = 1.0
    # the step
    max_tokens_per_micro_batch: int = 16384
    temperature: float = 1.0
    logprob_chunk_size: int | None = None  # None: models/logprobs.py LOGPROB_CHUNK_TOKENS
    peak_tflops: float | None = None
    debug_grad_norms: tuple | None = None  # logger.debug_grad_norms: (name patterns, top k)

    def __post_init__(self) -> None:
        self.gradient_checkpointing = {False: "none", True: "full"}.get(self.gradient_checkpointing,
                                                                       self.gradient_checkpointing)
