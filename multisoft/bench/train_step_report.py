"""results.md's training-step section: a small Llama trained with each loss, eager and compiled, a row per variant
against the torch loss of its mode and the target of a compiled step."""

from __future__ import annotations

from .cells import as_shown, number
from .records import TrainStepRecord

TARGET = 1.00  # a compiled step with multisoft's loss: its tokens/s as a multiple of the torch loss's, at least
LOSS_AGREEMENT = 1e-3  # the final loss's relative difference from the torch loss's, at most: the same training


def held_to_target(record: TrainStepRecord) -> bool:
    """Whether the row is held to TARGET: multisoft's loss (fused or not) in a compiled mode."""
    return record.mode != "eager" and record.loss != "torch"


def verdict(record: TrainStepRecord) -> str:
    """The row's note, then (compiled with multisoft) the target's verdict at two decimals, as the table shows it,
    and a final loss that strays from the torch loss's by more than LOSS_AGREEMENT."""
    texts = [record.note]
    if held_to_target(record):
        if record.tokens_per_s is None:
            texts.append("missed: not timed")
        elif record.of_torch is None:
            texts.append("missed: no torch loss to compare with")
        elif as_shown(record.of_torch) >= TARGET:
            texts.append("met")
        else:
            texts.append(f"missed: {as_shown(record.of_torch):.2f}× < {TARGET:.2f}×")
    if record.loss_vs_torch is not None and record.loss_vs_torch > LOSS_AGREEMENT:
        texts.append(f"final loss off the torch loss's by {record.loss_vs_torch:.1e} > {LOSS_AGREEMENT:.0e}")
    return "; ".join(text for text in texts if text)


def _error(value) -> str:
    return "—" if value is None else f"{value:.1e}"


def train_step_section(found: list[TrainStepRecord]) -> list[str]:
    """The section: what is measured and the target, then the table, in run order."""
    if not found:
        return []
    models = ", ".join(dict.fromkeys(r.model for r in found))
    lines = ["## Training step of a small Llama", "",
             f"A causal decoder of Llama's architecture in plain torch ({models}; `train_step model`) trained on "
             "random tokens, the mean next-token loss: **torch**, `F.cross_entropy(lm_head(h).float(), target)` as "
             "Hugging Face's `LlamaForCausalLM` computes it; **multisoft**, `multisoft.cross_entropy(lm_head(h), "
             "target, backend=b)`; **multisoft-fused**, `multisoft.linear_cross_entropy(h, lm_head.weight, target, "
             "backend=b)`. A step: `zero_grad(set_to_none=True)`, the forward and the loss, `backward()`, an AdamW "
             "step (`foreach=True`). Mode **eager**, or the forward and the loss as one function under "
             "`torch.compile` (**compiled**: the default mode; **reduce-overhead**: CUDA graphs); the optimizer's "
             "step is eager in every mode, so only the loss differs within a mode. Timed as `train_step timing` "
             "says, the host included: **tokens/s** (B·T tokens a step), **× torch** of the torch loss's tokens/s "
             "in the same mode, **peak GiB** `torch.cuda.max_memory_allocated()` during one step (weights, "
             "gradients and AdamW's state included), **first step s** the first step's wall time (compiling "
             "included), **final loss** after the steps timed: every variant starts from the same weights and takes "
             f"the same steps on the same batches, so it should be the torch loss's to {LOSS_AGREEMENT:.0e} "
             "(**vs torch**: the relative difference). The target: a compiled step with multisoft ≥ "
             f"{TARGET:.2f}× the torch loss's tokens/s (two decimals, as shown). `train_step.csv` has every number.",
             "",
             "| mode | loss | backend | tokens/s | × torch | peak GiB | first step s | final loss | vs torch "
             "| target, note |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in found:
        lines.append(f"| {r.mode} | {r.loss} | {r.backend or '—'} | {number(r.tokens_per_s, 0)} | "
                     f"{number(r.of_torch, 2)} | {number(r.peak_gib, 2)} | {number(r.first_step_s, 1)} | "
                     f"{number(r.final_loss, 4)} | {_error(r.loss_vs_torch)} | {verdict(r)} |")
    return lines + [""]
