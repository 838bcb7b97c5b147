"""A training step of a small Llama (``--ops train_step``, alias ``step``): what a user training a model gets from
multisoft's loss, eager and under ``torch.compile``, against the model's own loss.

The model is a causal decoder of Llama's architecture in plain torch (``Decoder``: embedding, blocks of RMSNorm,
rotary causal self-attention, RMSNorm and a SwiGLU MLP, a final RMSNorm, an untied ``lm_head``), at the size of
a small Hugging Face Llama (``ModelConfig``). Its forward gives the final hidden states; the loss, applied outside,
is one of LOSSES: ``torch`` (``F.cross_entropy`` of the float32 logits, what Hugging Face's ``LlamaForCausalLM`` does),
``multisoft`` (``multisoft.cross_entropy`` of the logits) or ``multisoft-fused`` (``multisoft.linear_cross_entropy``
of the hidden states and ``lm_head.weight``, no logits). A step: ``zero_grad(set_to_none=True)``, the forward and
the loss, ``backward()``, an AdamW step. In each of MODES the model's forward and the loss run eager or compiled as
one function; the optimizer's step is eager in every mode, so only the loss differs between the rows of a mode.

Every variant starts from the same weights (one seed) and takes the same steps on the same batches, so their final
losses differ only as float32's rounding grows over the steps: AdamW divides each gradient by its running size, so
rounding in a near-zero gradient becomes a whole step (H100, torch 2.11, 2026-12-05: 130 steps took torch's own
eager and compiled losses 1e-2 apart). A variant that fails (an exception, out of memory, a compiler error) gets
the reason in its record and the run goes on.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import plan, timing
from .impls import backend_impl
from .records import TrainStepRecord, describe_error

OP = "train_step"
TORCH_LOSS, MULTISOFT_LOSS, FUSED_LOSS = LOSSES = ("torch", "multisoft", "multisoft-fused")
# The mode of each row and the torch.compile mode of its forward (None: eager). Each compiled variant costs its
# compile (30-60 s on a GPU host), so the compiled modes run the torch loss and the first backend's two losses only.
MODES = {"eager": None, "compiled": "default", "reduce-overhead": "reduce-overhead"}
SEED = 0
BATCHES = 4  # distinct batches of random tokens, taken in turn
LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model and its batch; the defaults: a Llama of vocabulary 32000, hidden 256, 4 layers, batch 8 x 256
    tokens, fp32, ``intermediate`` Llama's 8/3 x hidden rounded."""

    vocab: int = 32000
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 688
    batch: int = 8
    sequence: int = 256
    dtype: str = "fp32"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02  # Hugging Face's initializer_range: every linear and embedding weight ~ N(0, std)

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "intermediate", "batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.sequence, int) or self.sequence < 2:
            raise ValueError(f"sequence must be an int >= 2 (a token and the one it predicts), got {self.sequence!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden must split into heads of an even size (rotary embedding), got hidden "
                             f"{self.hidden} and heads {self.heads}")
        if self.dtype not in plan.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(plan.DTYPES)}, got {self.dtype!r}")

    @property
    def label(self) -> str:
        return (f"vocab {self.vocab}, hidden {self.hidden}, {self.layers} layers, {self.heads} heads, MLP "
                f"{self.intermediate}, batch {self.batch}x{self.sequence}, {self.dtype}")


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """How many steps each variant takes: ``warmup`` (the first timed alone, the peak memory taken of the last),
    then ``repeats`` times ``timed`` steps, each repeat timed as a whole."""

    warmup: int = 5
    timed: int = 25
    repeats: int = 5

    def __post_init__(self):
        if self.warmup < 2 or self.timed < 1 or self.repeats < 1:
            raise ValueError(f"warmup must be >= 2, timed and repeats >= 1, got {self}")


QUICK_CONFIG = ModelConfig(vocab=512, hidden=64, layers=2, heads=2, intermediate=172, batch=2, sequence=32)
QUICK_COUNTS = StepCounts(warmup=2, timed=5, repeats=3)


@dataclasses.dataclass(frozen=True)
class Variant:
    mode: str  # a key of MODES
    loss: str  # one of LOSSES
    backend: str = ""  # the multisoft backend; "" for the torch loss


def config(quick: bool) -> ModelConfig:
    return QUICK_CONFIG if quick else ModelConfig()


def counts(quick: bool) -> StepCounts:
    return QUICK_COUNTS if quick else StepCounts()


def timing_note(step_counts: StepCounts) -> str:
    return (f"one step: zero_grad(set_to_none=True), forward and loss, backward(), AdamW(lr={LEARNING_RATE:g}, "
            f"foreach=True) step; {step_counts.warmup} warm-up steps (the first timed alone, the peak memory of the "
            f"last), then {step_counts.repeats} repeats of {step_counts.timed} steps, each repeat between "
            "torch.cuda.synchronize() calls (host included); tokens/s: the median repeat's")


def environment_notes(model_config: ModelConfig, step_counts: StepCounts) -> dict:
    """The run's environment entries of this op: the model and how a step is timed."""
    return {"train_step model": f"Llama-architecture decoder in plain torch: {model_config.label}",
            "train_step timing": timing_note(step_counts)}


def variants(backends: list[str], modes: tuple | None = None) -> list[Variant]:
    """Per mode of ``modes`` (default: every one of MODES): the torch loss, then multisoft's two losses on every
    backend (eager) or on the first backend, the default one (a compiled mode)."""
    chosen = []
    for mode in tuple(MODES) if modes is None else modes:
        if mode not in MODES:
            raise ValueError(f"modes must be of {', '.join(MODES)}, got {mode!r}")
        chosen.append(Variant(mode, TORCH_LOSS))
        for backend in backends if MODES[mode] is None else backends[:1]:
            chosen += [Variant(mode, MULTISOFT_LOSS, backend), Variant(mode, FUSED_LOSS, backend)]
    return chosen


# -- the model


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        wide = x.float()
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotary_tables(length: int, inv_freq, dtype) -> tuple:
    """The cosines and sines (T, head size) of the rotary position embedding of positions 0 .. length - 1."""
    angles = torch.outer(torch.arange(length, device=inv_freq.device, dtype=inv_freq.dtype), inv_freq)
    angles = torch.cat((angles, angles), -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, cos, sin):
    """The rotary position embedding of (B, heads, T, head size) ``x``, in Llama's rotate-half form."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Attention(nn.Module):
    def __init__(self, model_config: ModelConfig):
        super().__init__()
        size = model_config.hidden
        self.heads = model_config.heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(size, size, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        batch, length, size = x.shape
        q, k, v = (project(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for project in (self.q_proj, self.k_proj, self.v_proj))
        attended = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, size))


class Block(nn.Module):
    def __init__(self, model_config: ModelConfig):
        super().__init__()
        size, inner = model_config.hidden, model_config.intermediate
        self.attention_norm = RMSNorm(size, model_config.norm_eps)
        self.attention = Attention(model_config)
        self.mlp_norm = RMSNorm(size, model_config.norm_eps)
        self.gate_proj, self.up_proj = nn.Linear(size, inner, bias=False), nn.Linear(size, inner, bias=False)
        self.down_proj = nn.Linear(inner, size, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        normed = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))


class Decoder(nn.Module):
    """A causal decoder of Llama's architecture; ``forward(tokens)`` (B, T) gives the final hidden states
    (B, T, hidden), and ``lm_head`` (untied from the embedding) is left to the loss."""

    def __init__(self, model_config: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(model_config.vocab, model_config.hidden)
        self.blocks = nn.ModuleList(Block(model_config) for _ in range(model_config.layers))
        self.norm = RMSNorm(model_config.hidden, model_config.norm_eps)
        self.lm_head = nn.Linear(model_config.hidden, model_config.vocab, bias=False)
        head_size = model_config.hidden // model_config.heads
        exponents = torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
        self.register_buffer("inv_freq", model_config.rope_theta ** -exponents, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=model_config.init_std)

    def forward(self, tokens):
        x = self.embed(tokens)
        cos, sin = rotary_tables(tokens.shape[1], self.inv_freq, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def make_model(model_config: ModelConfig, device, seed: int = SEED) -> Decoder:
    """The decoder, its weights drawn on the CPU from ``seed`` (the same on any device), in the config's dtype."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(model_config)
    return model.to(device=device, dtype=getattr(torch, plan.DTYPES[model_config.dtype]))


def make_batches(model_config: ModelConfig, device, count: int = BATCHES, seed: int = SEED):
    """(count, B, T) random tokens, drawn on the CPU from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (count, model_config.batch, model_config.sequence)
    return torch.randint(0, model_config.vocab, shape, generator=generator).to(device)


# -- the losses and the step


def make_loss(name: str, backend: str = "") -> Callable:
    """The loss ``name`` (one of LOSSES; multisoft's on ``backend``) as f(model, hidden, tokens) -> the mean
    next-token loss, ``hidden[:, :-1]`` predicting ``tokens[:, 1:]``."""
    import multisoft

    def torch_loss(model, hidden, tokens):
        logits = model.lm_head(hidden[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def multisoft_loss(model, hidden, tokens):
        logits = model.lm_head(hidden[:, :-1])
        return multisoft.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                                       backend=backend)

    def fused_loss(model, hidden, tokens):
        return multisoft.linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                              tokens[:, 1:].reshape(-1), backend=backend)

    losses = dict(zip(LOSSES, (torch_loss, multisoft_loss, fused_loss)))
    if name not in losses:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {name!r}")
    return losses[name]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=True, fused=False)


def make_step(model: nn.Module, loss: Callable, optimizer: torch.optim.Optimizer, mode: str = "eager") -> Callable:
    """One training step, f(tokens) -> the loss (detached): the gradients set to None, the forward and ``loss``
    (compiled together as ``mode`` says), ``backward()``, the optimizer's step (eager)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")

    def forward(tokens):
        return loss(model, model(tokens), tokens)

    if MODES[mode] is not None:
        forward = torch.compile(forward, mode=MODES[mode])
    graphed = MODES[mode] == "reduce-overhead"

    def step(tokens):
        optimizer.zero_grad(set_to_none=True)
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        value = forward(tokens)
        value.backward()
        optimizer.step()
        return value.detach()
    return step


# -- a run


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant: Variant, model_config: ModelConfig, step_counts: StepCounts, device,
            record: TrainStepRecord) -> None:
    """Train a fresh model as ``variant`` says, filling ``record``: the first step's seconds, the peak memory of
    the last warm-up step (on a GPU), the median tokens/s of the timed repeats and the last step's loss."""
    model = make_model(model_config, device)
    step = make_step(model, make_loss(variant.loss, variant.backend), make_optimizer(model), variant.mode)
    feed = itertools.cycle(make_batches(model_config, device))
    _synchronize(device)
    begun = time.perf_counter()
    last = step(next(feed))
    _synchronize(device)
    record.first_step_s = time.perf_counter() - begun
    for _ in range(step_counts.warmup - 2):
        last = step(next(feed))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    last = step(next(feed))
    if device.type == "cuda":
        record.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    rates = []
    for _ in range(step_counts.repeats):
        _synchronize(device)
        begun = time.perf_counter()
        for _ in range(step_counts.timed):
            last = step(next(feed))
        _synchronize(device)
        rates.append(model_config.batch * model_config.sequence * step_counts.timed / (time.perf_counter() - begun))
    record.tokens_per_s = statistics.median(rates)
    record.final_loss = last.item()


def compare_with_torch(found: list[TrainStepRecord]) -> None:
    """Each record's tokens/s and final loss against the torch loss's of the same mode."""
    baseline = {r.mode: r for r in found if r.loss == TORCH_LOSS}
    for record in found:
        torch_record = baseline.get(record.mode)
        if torch_record is None:
            continue
        if record.tokens_per_s is not None and torch_record.tokens_per_s:
            record.of_torch = record.tokens_per_s / torch_record.tokens_per_s
        if record.final_loss is not None and torch_record.final_loss:
            record.loss_vs_torch = abs(record.final_loss - torch_record.final_loss) / abs(torch_record.final_loss)


def run_cases(runner, chosen: list[Variant], model_config: ModelConfig,
              step_counts: StepCounts) -> list[TrainStepRecord]:
    """A record per variant of ``chosen``, in order (a backend that cannot run here, or a variant that fails, has
    the reason as its note), compared with the torch loss of its mode."""
    found = []
    for variant in chosen:
        runner.progress.step(f"{OP} {variant.mode} {variant.loss} {variant.backend}".rstrip())
        record = TrainStepRecord(variant.mode, variant.loss, variant.backend, model_config.label)
        found.append(record)
        if variant.backend:
            record.note = runner.skip_reason(backend_impl(variant.backend), OP, model_config.dtype)
            if record.note:
                continue
        compiled = MODES[variant.mode] is not None
        if compiled:
            torch._dynamo.reset()
        try:
            measure(variant, model_config, step_counts, runner.device, record)
        except Exception as error:  # noqa: BLE001 - out of memory, a failing kernel or compiler: noted, go on
            record.note = describe_error(error)
            runner.note(f"{OP} {variant.mode} {variant.loss} {variant.backend}: {record.note}")
        if compiled:
            torch._dynamo.reset()
        timing.recover()
    compare_with_torch(found)
    return found
