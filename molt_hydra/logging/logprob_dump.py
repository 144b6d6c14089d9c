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
    with open(tmp, "w") as f:
        f.write("\t".join(COLUMNS) + "\n")
        for i, n in enumerate(lengths):
            rid = str(batch.rollout_ids[i]).replace("\t", " ")
            ids, mask = batch.token_ids[i, :n].tolist(), batch.action_mask[i, :n].int().tolist()
            versions = batch.policy_versions[i, :n].tolist()
            vllm, train = batch.rollout_log_probs[i, :n].tolist(), train_logp[i, :n].tolist()
            for pos in range(n):  # %.9g: float32 values round-trip exactly
                f.write(f"{i}\t{rid}\t{pos}\t{ids[pos]}\t{versions[pos]}\t{mask[pos]}\t{vllm[pos]:.9g}\t"
                        f"{train[pos]:.9g}\n")
    tmp.replace(path)  # complete or absent
