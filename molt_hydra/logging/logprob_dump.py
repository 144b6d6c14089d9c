"""logger.dump_logprobs (Molt's MOLT_DUMP_ROLLOUT_LOGPROBS): one RL step's per-token engine vs trainer log-probs as a
TSV under the run directory, for chosen steps (logger.dump_logprobs_steps). The schema is docs/logprob_dump.md; a
notebook reads it with `pandas.read_csv(path, sep="\\t")`. The trainer log-probs are the ones the step's drift metrics
(`vllm_kl`, `drift/*`) compare, so the masked mean of `vllm_logp - train_logp` over a file is that step's `vllm_kl`."""

from __future__ import annotations

from pathlib import Path


COLUMNS = ("sample", "rollout_id", "pos", "token_id", "version", "mask", "vllm_logp", "train_logp")


def write_logprob_dump(path: Path, batch, train_logp, lengths: list[int]) -> None:
    """`batch`: the step's ExperienceBatch ([B, L] rows); `train_logp`: [B, L]; `lengths`: each row's real tokens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    per_token = (batch.token_ids, batch.policy_versions, batch.action_mask.int(), batch.rollout_log_probs, train_logp)
    with open(tmp, "w") as f:
        f.write("\t".join(COLUMNS) + "\n")
        for i, n in enumerate(lengths):
            rid = str(batch.rollout_ids[i]).replace("\t", " ")
            for pos, (token, version, mask, vllm, train) in enumerate(zip(*(t[i, :n].tolist() for t in per_token))):
                # %.9g: float32 values round-trip exactly
                f.write(f"{i}\t{rid}\t{pos}\t{token}\t{version}\t{mask}\t{vllm:.9g}\t{train:.9g}\n")
    tmp.replace(path)  # complete or absent
