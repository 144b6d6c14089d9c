"""Resumable checkpoints (torch.distributed.checkpoint) and HF export.

Layout: <root>/step_<N>/{dcp/ (model + optimizer, sharded), extra_state.pt (scheduler + client state),
rng_rank<r>.pt, crc32.json}, <root>/latest (text: the last tag, for people and tools; a resume takes the newest
complete step, whatever the tag says). A save is written to <root>/.tmp-step_<N> and renamed
only when complete, so a crash mid-save leaves the previous checkpoint, and `latest`, loadable (the next save removes
the half-written directory); a step saved again (its first save damaged) replaces it through .old-step_<N>
(`_replace_dir`), which `recover` puts back after a crash in between. Neither DCP nor torch.load checks
checksums: crc32.json, written last, holds every file's CRC32, which a resume checks (a shard's bytes overwritten
at its full length loaded as garbage weights, silently).
Retention (newest `keep` tags, a disk budget) is parallel/retention.py. Assumes every rank sees the same filesystem
(one host, or a shared mount).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import random
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from molt_hydra.config.schema import WEIGHTS_ALONE
from molt_hydra.models import lora
from molt_hydra.models.hub_cache import local_dir
from molt_hydra.parallel import retention
from molt_hydra.parallel.crc_reader import ChecksumMismatch, SummingReader

log = logging.getLogger(__name__)
TAG = re.compile(r"^step_(\d+)$")
CRCS = "crc32.json"  # {file under step_<N>: CRC32}


class DamagedCheckpoint(RuntimeError):
    """A load that found a shard's bytes changed since the save (args: the message; "<checkpoint>: <file>: <its
    CRC32s>"); every
    rank raises it (DCP gathers the ranks' read errors), the model's state half loaded: the caller loads another
    checkpoint or stops."""

    def __str__(self) -> str:
        return f"{self.args[0]}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_loadable(path: Path) -> bool:
    return (path / "extra_state.pt").is_file() and (path / "dcp" / ".metadata").is_file()


def _dcp_state(model, optimizer=None) -> dict:
    """What DCP saves and loads: the model's (sharded) state dict, and the optimizer's when given."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _write_extra(tmp: Path, extra: dict) -> None:
    """The last write before the rename: its own function, so the crash test can kill a save exactly here."""
    _save_small(extra, tmp / "extra_state.pt")


def _save_small(obj, path: Path) -> None:
    """torch.save through memory: a failed write is an OSError naming the cause (a full disk: ENOSPC). Before, torch's
    zip writer on the file raised 'enforce fail at inline_container.cc ... unexpected pos', then aborted the
    process as it closed the file ('terminate called without an active exception')."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        path.write_bytes(buffer.getbuffer())
    except OSError as e:  # a write to the open file names no file
        raise OSError(e.errno, e.strerror, str(path)) from e


def _replace_dir(tmp: Path, final: Path) -> None:
    """A finished directory takes `final`'s place: what was there is renamed aside (.old-<name>), `tmp` renamed in,
    and the old one removed last, so a crash at any point leaves a whole copy under `final`, or, between the two
    renames, under .old-<name>, which `recover` puts back. Before: `final` was removed first; a crash before the
    rename lost it (a checkpoint, `best`, the export), its new copy left in a .tmp- directory no resume considers."""
    _settle(final)
    if final.is_dir():  # (a file in its place fails the rename below, naming it)
        os.replace(final, _old(final))
    os.replace(tmp, final)
    shutil.rmtree(_old(final), ignore_errors=True)


def _old(final: Path) -> Path:
    return final.with_name(f".old-{final.name}")


def _settle(final: Path) -> None:
    """What a crash in `_replace_dir` left of `final`: its .old-<name> is put back where `final` is missing (a crash
    between the two renames), else removed (a crash as it was removed)."""
    if not _old(final).exists():
        return
    if final.exists():
        shutil.rmtree(_old(final))
    else:
        os.replace(_old(final), final)


def recover(root: str | os.PathLike) -> None:
    """Rank 0, or the driver before any role starts: every directory under `root` a crash in `_replace_dir` left
    aside (a checkpoint, `best`) is put back, or removed where its replacement is in place."""
    for old in Path(root).glob(".old-*"):
        _settle(old.with_name(old.name.removeprefix(".old-")))


def _tags(root: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := TAG.match(p.name)) and is_loadable(p))


def save_checkpoint(root: str | os.PathLike, step: int, model, optimizer=None, scheduler=None,
                    client_state: dict | None = None, keep: int = 3, max_disk_gb: float | None = None,
                    hold: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the final directory. Retention: parallel/retention.py (`hold`: a step
    it keeps besides). Every rank raises the same error when a write failed on any rank (naming that rank and the
    cause: a full disk...; the half-written save is removed, its space freed), or when the newest checkpoint alone
    is over `max_disk_gb`."""
    root, tag = Path(root), f"step_{step}"
    tmp, final = root / f".tmp-{tag}", root / tag
    _on_every_rank(tmp, _prepare, root, tmp, rank0_only=True)
    try:
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp / "dcp"))
    except dcp.api.CheckpointException as e:  # its message names only the failing ranks: name the cause (disk full...)
        rank, (cause, _) = next(iter(e.failures.items()))
        why = f"{type(cause).__name__}: {cause}"
        if "unexpected pos" in why:  # torch's zip writer after a short write, the OSError (disk full...) lost
            why += f" (a short write: {shutil.disk_usage(root).free / 1e9:.3g} GB free on its disk; a full disk, a " \
                   "quota or a file-size limit)"
        _remove(tmp)
        raise RuntimeError(f"writing {tmp} failed on rank {rank}: {why}") from e
    crcs = _on_every_rank(tmp, _write_rank_files, tmp)
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, crcs)
        crcs = {name: crc for part in every for name, crc in part.items()}
    world = dist.get_world_size() if dist.is_initialized() else 1  # rng_rank<r>.pt for every r below it
    extra = {"client_state": client_state or {}, "step": step, "world_size": world, "crc32": True,
             "scheduler": scheduler.state_dict() if scheduler is not None else None}
    held = root / f"step_{hold}" if hold is not None else None
    _on_every_rank(tmp, _publish, tmp, final, extra, crcs, keep, max_disk_gb, held, rank0_only=True)
    if (error := retention.over_budget(final, max_disk_gb)) is not None:
        raise RuntimeError(error)
    return final


def _prepare(root: Path, tmp: Path) -> None:
    """What a killed save, prune or export left (the run lock keeps other writers out): a step's and an HF snapshot's
    (retention.SNAPSHOTS) .tmp- and .pruned- copies, `best`'s .tmp- one, are removed (before: an export's stayed until
    the same name was exported again, a snapshot's for good), and what `_replace_dir` left aside put back."""
    root.mkdir(parents=True, exist_ok=True)
    for where in (root, root / retention.SNAPSHOTS):
        recover(where)  # (before retention counts the steps, and before the .tmp- copies go)
        for leftover in [*where.glob(".tmp-step_*"), *where.glob(".pruned-step_*")]:
            shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(root / ".tmp-best", ignore_errors=True)
    tmp.mkdir()


def _write_rank_files(tmp: Path) -> dict[str, int]:
    """This rank's RNG streams (restored on load); returns the CRC32s of its files."""
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), **cuda}
    _save_small(rng, tmp / f"rng_rank{_rank()}.pt")
    return {f"dcp/{p.name}": _crc32(p) for p in (tmp / "dcp").glob(f"__{_rank()}_*")}  # each rank its own shards


def _publish(tmp: Path, final: Path, extra: dict, crcs: dict, keep: int, max_disk_gb: float | None,
             hold: Path | None) -> None:
    """Rank 0: the extra state and the CRC32s, written last, then the rename that makes the save a checkpoint."""
    _write_extra(tmp, extra)
    crcs.update({str(p.relative_to(tmp)): _crc32(p) for p in [tmp / "dcp" / ".metadata", *tmp.glob("*.pt")]})
    (tmp / CRCS).write_text(json.dumps(crcs))
    _replace_dir(tmp, final)
    latest_tmp = final.parent / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, final.parent / "latest")
    retention.prune([p for _, p in _tags(final.parent)], keep, max_disk_gb, hold)


def _on_every_rank(tmp: Path, step, *args, rank0_only: bool = False):
    """`step(*args)` on every rank (`rank0_only`: on rank 0, the others wait), then a collective that tells every
    rank whether it failed anywhere: each one then raises, naming the first rank that failed and its cause (and the
    half-written save is removed). Before: the rank whose write failed (a disk full as rank 0 wrote
    extra_state.pt) raised alone; the others waited in the next barrier until the collective timeout, which the run
    then named. Returns `step`'s result."""
    result, error = None, None
    try:
        if _rank() == 0 or not rank0_only:
            result = step(*args)
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        error = e
    every = [error and f"{type(error).__name__}: {error}"]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, error and f"{type(error).__name__}: {error}")
    failed = [(rank, why) for rank, why in enumerate(every) if why]
    if failed:
        _remove(tmp)
        raise RuntimeError(f"writing {tmp} failed on rank {failed[0][0]}: {failed[0][1]}") from error
    return result


def _remove(tmp: Path) -> None:
    """Rank 0: a failed save's directory (a full disk gets its space back)."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def problem(path: Path, checksums: bool = False) -> str | None:
    """Why the checkpoint at `path` cannot be resumed (a file missing, truncated or unreadable), else None. The small
    files are read whole; of the shards, that each one DCP's metadata names is there at its full length. With
    `checksums` (the run's check before it starts), every small file's CRC32 is the one recorded at save (a
    checkpoint saved before 2026-12-05 recorded none); the shards' are checked by the load, as it reads them
    (parallel/crc_reader.py: the shards are read once)."""
    return _checked(path, checksums)[0]


def _checked(path: Path, checksums: bool = False) -> tuple[str | None, dict | None]:
    """`problem`'s answer, and the extra state it read (None where it is not loadable): the load reads that file, which
    holds the loop's queued batches, once."""
    what = "extra_state.pt"
    try:
        extra = torch.load(path / what, weights_only=False)
        what = "dcp/.metadata"
        storage = dcp.FileSystemReader(str(path / "dcp")).read_metadata().storage_data.values()
        for info in storage:
            what = f"dcp/{info.relative_path}"
            if (path / what).stat().st_size < info.offset + info.length:
                raise EOFError(f"{(path / what).stat().st_size} bytes, the metadata expects "
                               f"{info.offset + info.length}")
        for rank in range(extra.get("world_size", 0)):  # (a checkpoint of an older version did not record it)
            what = f"rng_rank{rank}.pt"
            torch.load(path / what, weights_only=False)
    except Exception as e:  # noqa: BLE001 - whatever the reason, this checkpoint cannot be resumed
        cause = e.strerror if isinstance(e, OSError) and e.strerror else f"{e}".split(". ")[0] or type(e).__name__
        return f"{what}: {cause}", None
    if not (checksums and extra.get("crc32")):
        return None, extra
    try:
        crcs = json.loads((path / CRCS).read_text())
    except (OSError, ValueError) as e:
        return f"{CRCS}: {e.strerror if isinstance(e, OSError) and e.strerror else e}", None
    for name in sorted(n for n in crcs if not _is_shard(n)):  # the shards' are checked as the load reads them
        if (crc := _crc32(path / name)) != crcs[name]:
            return f"{name}: CRC32 {crc:08x}, saved as {crcs[name]:08x} (its bytes changed since the save)", None
    return None, extra


def _is_shard(name: str) -> bool:
    return name.endswith(".distcp")


def _shard_crcs(path: Path) -> dict[str, int]:
    """The shards' CRC32s recorded at save ({} for a checkpoint saved before they were)."""
    try:
        return {name: crc for name, crc in json.loads((path / CRCS).read_text()).items() if _is_shard(name)}
    except FileNotFoundError:
        return {}


def saved_client_state(path: Path) -> dict:
    """What the trainer recorded with the checkpoint at `path` (global_step, master_weights, the job's own counts)."""
    return torch.load(path / "extra_state.pt", weights_only=False)["client_state"]


def saved_master_weights(path: Path, client_state: dict | None = None) -> str:
    """The model.master_weights the checkpoint at `path` was saved under: recorded in its client state (since
    2026-12-05; `client_state` when already read); in an older one, told by its model tensors' dtypes in DCP's
    metadata: fsdp's are all fp32, optimizer's parameters are in the compute dtype (their fp32 masters are optimizer
    state)."""
    recorded = (saved_client_state(path) if client_state is None else client_state).get("master_weights")
    if recorded is not None:
        return recorded
    meta = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    dtypes = {m.properties.dtype for key, m in meta.items() if key.startswith("model.") and hasattr(m, "properties")}
    return "fsdp" if dtypes <= {torch.float32} else "optimizer"


def _candidates(root: Path, older_than: Path | None = None) -> list[Path]:
    """The checkpoints to try, newest step first: every step_<N>, and the `latest` tag's (when readable) even where its
    directory is missing (then named as such). The order is the steps', not the tag's: a save renames its step into
    place before it rewrites `latest`, so after a crash between the two the tag names the step before a complete one
    (before: that older step was resumed, the newer one's training lost and its step numbers trained again)."""
    tags = {int(m.group(1)): p for p in root.glob("step_*") if (m := TAG.match(p.name)) and p.is_dir()}
    try:
        latest = TAG.match((root / "latest").read_text().strip())
    except (OSError, UnicodeDecodeError):  # absent, a directory, garbage: the step directories decide
        latest = None
    if latest:
        tags.setdefault(int(latest.group(1)), root / latest.group(0))
    below = int(TAG.match(older_than.name).group(1)) if older_than is not None else None
    return [tags[step] for step in sorted(tags, reverse=True) if below is None or step < below]


def resolve_checkpoint(root: str | os.PathLike, skipped: list[str] | None = None, checksums: bool = False,
                       older_than: Path | None = None) -> Path | None:
    """The newest loadable step_<N>, else None. Each checkpoint passed over (a `latest` naming a missing directory,
    a file missing, truncated or unreadable; with `checksums`, a small file changed since the save) is appended to
    `skipped` as "<path>: <why>". `older_than` (a step_<N>): only steps before it (a load found its shard
    damaged)."""
    root = Path(root)
    for path in _candidates(root, older_than) if root.is_dir() else []:
        why = "missing" if not path.is_dir() else problem(path, checksums)
        if why is None:
            return path
        if skipped is not None:
            skipped.append(f"{path}: {why}")
    return None


def load_checkpoint(root: str | os.PathLike, model, optimizer=None, scheduler=None, model_only: bool = False,
                    master_weights: str | None = None, step: str | None = None,
                    into: dict | None = None, seed: int = 0) -> dict | None:
    """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns the client state, or None when
    there is nothing to resume from. `model_only` (a warm start): the weights alone, and no client state.
    `master_weights`: this run's model.master_weights; a resume (not a warm start) of a checkpoint saved under the
    other mode is refused before anything loads (the two optimizer states differ in kind). `step` (a step_<N>
    name): that checkpoint, not the newest loadable one: every role of a run resumes the step the actor's resolved
    to, and a role whose own is missing or damaged is an error naming it. `into` (with `model_only`): the tensors
    the weights load into, by name, instead of the model's (the fp32 masters of model.master_weights=optimizer).
    `seed`: the run's, for the RNG streams of a resume on another number of ranks than saved (_restore_rng)."""
    path = resolve_checkpoint(root) if step is None else Path(root) / step
    if path is None:
        return None
    why, extra = (("missing", None) if not path.is_dir() else _checked(path)) if step is not None else (None, None)
    if why is not None:
        raise ValueError(f"{path}: {why}; every role resumes {step}, the actor's newest loadable checkpoint. Fix: "
                         f"move {step} and any later step out of the actor's checkpoint.dir (the one before it is "
                         "then resumed), or resume with checkpoint.resume=never")
    optimizer = None if model_only else optimizer
    if extra is None and not model_only:  # (read by the check above where it ran)
        extra = torch.load(path / "extra_state.pt", weights_only=False)
    if (optimizer is not None and master_weights is not None
            and (saved := saved_master_weights(path, extra["client_state"])) != master_weights):
        raise ValueError(f"model.master_weights: {path} was saved with model.master_weights={saved}, this run has "
                         f"{master_weights}; its optimizer state cannot be resumed across the two. Fix: set "
                         f"model.master_weights={saved} (or its weights alone: {WEIGHTS_ALONE})")
    state = {"model": into} if into is not None else _dcp_state(model, optimizer)
    try:
        # without an optimizer: the model's entries only; each shard's CRC32 is checked as it is read
        dcp.load(state, storage_reader=SummingReader(path / "dcp", _shard_crcs(path)))
    except dcp.api.CheckpointException as e:  # damage the checks of `problem` cannot see (a shard's bytes changed)
        rank, (cause, _) = next(iter(e.failures.items()))
        error = DamagedCheckpoint if isinstance(cause, ChecksumMismatch) else RuntimeError
        raise error(f"reading {path} failed on rank {rank}: {type(cause).__name__}: {cause}. Fix: move {path} out of "
                    "the checkpoint directory to resume from the one before it", f"{path}: {cause}") from e
    if into is None:
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
    if model_only:
        return {}
    if scheduler is not None and extra["scheduler"] is not None:
        scheduler.load_state_dict(extra["scheduler"])
    _restore_rng(path, extra, seed)
    return extra["client_state"]


def _restore_rng(path: Path, extra: dict, seed: int) -> None:
    """This rank's RNG streams, as saved. On another number of ranks than saved, no saved stream is a rank's own
    (before: a rank beyond the saved ones kept the stream it was built with, the others took theirs, without a word):
    every rank seeds python, numpy and torch from `seed` + the step, alike, as a fresh run's ranks start, and rank 0
    says so in one line."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved = extra.get("world_size") or len(list(path.glob("rng_rank*.pt")))  # (recorded since 2026-12-05)
    if saved != world:
        reseed = (seed + extra["step"]) % 2**32
        random.seed(reseed)
        np.random.seed(reseed)
        torch.manual_seed(reseed)  # (every device's CUDA stream too)
        if _rank() == 0:
            log.warning(f"Resuming {path} on {world} trainer ranks, saved on {saved}: its RNG streams are one per "
                        f"saved rank, so every rank's (python, numpy, torch) is seeded from seed + step = {reseed} "
                        f"instead, alike, as at a fresh start. The run goes on reproducibly, but not as it would have "
                        f"on {saved} ranks (each rank's share of a batch changes too); resume on {saved} ranks to "
                        "continue exactly.")
        return
    state = torch.load(path / f"rng_rank{_rank()}.pt", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def export_hf(out_dir: str | os.PathLike, model, *, tokenizer_path: str | None = None, base_path: str | None = None,
              dtype: torch.dtype = torch.bfloat16, to_hf=None, adapter: dict | None = None,
              merged: bool = False) -> Path | None:
    """Collective. Rank 0 writes safetensors + config (+ tokenizer) to out_dir via a temp dir; returns out_dir there.
    to_hf: (name, tensor) -> [(hf_name, tensor), ...] for models whose own names are not the checkpoint's.
    adapter: a LoRA spec (models/lora.py): the adapter in PEFT's format instead (its config naming `base_path`, else
    `tokenizer_path`, as its base), and with `merged` the base with the adapter merged in (W + alpha / rank * B @ A)
    as a full HF model under out_dir/merged."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if to_hf is not None:  # (a LoRA run's too: its merged model's experts; an adapter's names pass unchanged)
        sd = dict(pair for name, t in sd.items() for pair in to_hf(name, t))
    out = Path(out_dir).resolve()  # a link (to another disk): its target is replaced, the link stays
    tmp = out.with_name(f".tmp-{out.name}")

    def write():  # rank 0
        if adapter is None:
            _write_hf(out, sd, model.config, dtype, tokenizer_path)
            return
        shutil.rmtree(tmp, ignore_errors=True)  # through a temp dir beside `out`, the merged model under merged/
        tensors = {lora.peft_name(n): t.to(dtype) for n, t in sd.items() if lora.is_adapter_param(n)}
        lora.save_adapter(tmp, tensors, adapter, base_path or tokenizer_path)
        _save_tokenizer(tokenizer_path, tmp)
        if merged:
            config = copy.deepcopy(model.config)
            if "lm_head" in adapter["target_modules"]:  # the adapted head is no longer the embedding
                config.tie_word_embeddings = False
            _write_hf(tmp / "merged", lora.merged_state(sd, adapter["alpha"] / adapter["rank"]), config, dtype,
                      tokenizer_path)
        _replace_dir(tmp, out)

    # every rank raises rank 0's write error (a full disk...); before, the others waited for it in a barrier until
    # the collective timeout (30 min by default), and the run with them
    _on_every_rank(tmp, write, rank0_only=True)
    return out if _rank() == 0 else None


def _write_hf(out: Path, sd: dict, model_config, dtype: torch.dtype, tokenizer_path: str | None) -> None:
    """An HF model directory at `out` (through a temp dir beside it): safetensors in `dtype`, config, tokenizer."""
    from huggingface_hub import save_torch_state_dict

    config = copy.deepcopy(model_config)
    if getattr(config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    # an MoE expert given back per expert (moe_routing.checkpoint_expert_tensors) is a view of the fused tensor where
    # the cast copies nothing (exported in the dtype it is held in): its own copy, as safetensors refuses to write part
    # of a storage (was: the export failed, 'None is covering the entire storage', at the end of the run)
    save_torch_state_dict({k: t if t.untyped_storage().nbytes() == t.nbytes else t.clone() for k, t in tensors.items()},
                          tmp, max_shard_size="5GB")
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(tmp)
    if (local := _save_tokenizer(tokenizer_path, tmp)) is not None:
        for name in ("preprocessor_config.json", "processor_config.json"):  # a VLM's (image) processor
            if (local / name).is_file():
                shutil.copy(local / name, tmp)
    _replace_dir(tmp, out)


def _save_tokenizer(tokenizer_path: str | None, out: Path) -> Path | None:
    """The model's tokenizer beside its weights, when its directory has one; returns that directory. A hub id's
    (model.tokenizer_path=org/name, which the run's tokenizer loads from the HF cache): its snapshot there. Before:
    only a local directory's was exported, a hub id's tokenizer left out without a word."""
    local = local_dir(tokenizer_path) if tokenizer_path is not None else None
    if local is None and tokenizer_path is not None:  # (a host whose HF cache lacks it: said, the export goes on)
        log.warning("HF export: its tokenizer %s is neither a directory nor in this host's HF cache, so the export "
                    "carries none (save it beside the weights: AutoTokenizer.from_pretrained(%r).save_pretrained("
                    "<export dir>))", tokenizer_path, tokenizer_path)
    if local is None or not any(local.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(local).save_pretrained(out)
    return local

