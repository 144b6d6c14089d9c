"""Rules on the values a run hands to other code later: engine lengths, names vLLM looks up, agent kwargs, names and
addresses, MoE-only knobs. Each of these used to pass `dry_run=true` and fail (or do nothing) at run time.

Called from config/validate.py after derive(); each function appends to its `Problems`. Names are checked against the
installed library's own registry, imported only when the knob is set (importing vLLM costs seconds).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from enum import Enum
from urllib.parse import urlsplit


def length_rules(cfg, problems) -> None:
    """The engine must hold a whole context (prompt + all turns <= data.max_len); a turn's cap must leave a prompt."""
    r, d, e = cfg.rollout, cfg.data, cfg.eval
    problems.check(r.max_model_len >= d.max_len, "rollout.max_model_len",
                   f"{r.max_model_len} is below data.max_len={d.max_len}: a prompt and its turns may use up to "
                   f"{d.max_len} tokens, which the engine would refuse.",
                   f"set rollout.max_model_len >= {d.max_len} (or unset it: it defaults to data.max_len), or lower "
                   "data.max_len")
    if e.max_new_tokens is not None and e.max_new_tokens != r.max_new_tokens:  # rollout's own is checked already
        problems.check(e.max_new_tokens < d.max_len, "eval.max_new_tokens",
                       f"{e.max_new_tokens} leaves no room for the prompt within data.max_len={d.max_len}.",
                       "lower eval.max_new_tokens or raise data.max_len")
    chunked_off = cfg.cluster.device.value == "cpu" or r.enable_chunked_prefill is False
    problems.check(not (cfg.cluster.device.value != "cpu" and chunked_off and r.max_num_batched_tokens
                        and r.max_num_batched_tokens < r.max_model_len), "rollout.max_num_batched_tokens",
                   f"{r.max_num_batched_tokens} is below rollout.max_model_len {r.max_model_len} with chunked "
                   "prefill off: vLLM refuses to start such an engine.",
                   f"set it to at least {r.max_model_len}, unset it, or unset rollout.enable_chunked_prefill")
    t = cfg.train
    problems.check(not t.dynamic_batch or t.max_tokens_per_micro_batch >= d.max_len,
                   "train.max_tokens_per_micro_batch",
                   f"{t.max_tokens_per_micro_batch} is below data.max_len={d.max_len}: a full-length sample fits no "
                   "micro-batch.", f"set it to at least {d.max_len}, or lower data.max_len")


def _choice(problems, key: str, value, known, what: str) -> None:
    known = sorted(known)
    near = difflib.get_close_matches(str(value), known, n=1)
    hint = f" (did you mean {near[0]!r}?)." if near else "."
    problems.check(value in known, key, f"{value!r} is not {what}{hint}", f"use one of {known}, or unset {key}")


def _literal_values(hint) -> set:
    """The strings a `Literal[...]` (or a union holding one, e.g. `Literal[...] | None`) allows."""
    import typing

    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    return {v for arg in typing.get_args(hint) for v in _literal_values(arg)}


def engine_name_rules(cfg, problems) -> None:
    """Names vLLM resolves when an engine starts, checked against the installed vLLM's own enums and registries."""
    import typing

    r, agent = cfg.rollout, cfg.agent
    if r.attention_backend is not None or r.mm_encoder_attn_backend is not None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        for key in ("attention_backend", "mm_encoder_attn_backend"):
            if getattr(r, key) is not None:
                _choice(problems, f"rollout.{key}", getattr(r, key), AttentionBackendEnum.__members__,
                        "a vLLM attention backend")
    if r.mamba_ssm_cache_dtype is not None or r.gdn_prefill_backend is not None:
        import vllm.engine.arg_utils as arg_utils

        fields = {f.name: f.type for f in dataclasses.fields(arg_utils.EngineArgs)}
        for key in ("mamba_ssm_cache_dtype", "gdn_prefill_backend"):
            if getattr(r, key) is not None:
                hint = eval(fields[key], vars(arg_utils)) if isinstance(fields[key], str) else fields[key]  # noqa: S307
                names = _literal_values(hint)
                _choice(problems, f"rollout.{key}", getattr(r, key), names, f"a value vLLM's EngineArgs.{key} takes")
    if agent.tool_parser not in (None, "hermes"):  # hermes is vLLM's built-in default: no import for it
        from vllm.tool_parsers import ToolParserManager

        _choice(problems, "agent.tool_parser", agent.tool_parser,
                {*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers}, "a vLLM tool parser")
    if agent.reasoning_parser is not None:
        from vllm.reasoning import ReasoningParserManager

        _choice(problems, "agent.reasoning_parser", agent.reasoning_parser,
                ReasoningParserManager.list_registered(), "a vLLM reasoning parser")


def _kwarg_problems(problems, cls, kwargs: dict) -> None:
    """Bind kwargs to `cls`'s constructor as `cls(**kwargs)` would; report each unknown or missing one by its key."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to bind against
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for name in sorted(set(kwargs) - set(named)):
            near = difflib.get_close_matches(name, named, n=1)
            problems.check(False, f"agent.runner.{name}", f"{cls.__name__}({', '.join(named)}) takes no argument "
                           f"{name!r}" + (f" (did you mean {near[0]!r}?)." if near else "."),
                           f"remove +agent.runner.{name}" + (f" or spell it agent.runner.{near[0]}" if near else ""))
    for name, p in params.items():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and name not in kwargs:
            problems.check(False, f"agent.runner.{name}", f"{cls.__name__} needs it and it is not set.",
                           f"add +agent.runner.{name}=VALUE")


def agent_kwargs_rules(cfg, problems) -> None:
    """`agent.runner`'s kwargs against the constructors they reach: the Runner's, then the Env / ChatAgent's that a
    StepEnvRunner / ChatAgentRunner builds per rollout (built once here too, so its own checks run now)."""
    from molt_hydra.agents.base import Env, Runner
    from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner
    from molt_hydra.agents.loading import resolve_target
    from molt_hydra.agents.step_runner import StepEnvRunner

    spec = dict(cfg.agent.runner)
    try:
        cls = resolve_target(spec.pop("_target_", None))
    except Exception:  # noqa: BLE001 -- the _target_ rule of validate.py reports it
        return
    if not isinstance(cls, type):
        return
    before = len(problems.lines)
    _kwarg_problems(problems, cls, spec)
    if len(problems.lines) > before:
        return
    if issubclass(cls, (StepEnvRunner, ChatAgentRunner)):
        runner = cls(**spec)  # both only store their arguments
        cls, spec = (runner.env_cls, runner.env_kwargs) if isinstance(runner, StepEnvRunner) else (
            runner.agent_cls, runner.agent_kwargs)
        _kwarg_problems(problems, cls, spec)
    if len(problems.lines) == before and issubclass(cls, (Env, ChatAgent)) and not issubclass(cls, Runner):
        try:
            cls(**spec)
        except Exception as e:  # noqa: BLE001 -- whatever the agent's constructor refuses is a config error
            text = str(e).splitlines()[0][:300] if str(e) else ""
            named = re.match(r"(agent\.runner\.\w+): (.*) Fix: (.*)", text)  # already "key: reason Fix: fix"
            key, reason, fix = named.groups() if named else ("agent.runner", text, "fix the agent.runner.* kwargs")
            problems.check(False, key, f"{cls.__name__}(**agent.runner kwargs) raised {type(e).__name__}: {reason}",
                           fix)


def _string_fields(node, prefix: str, defaults):
    for f in dataclasses.fields(node):
        value, default = getattr(node, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            yield from _string_fields(value, f"{prefix}{f.name}.", default)
        elif isinstance(value, str) and not isinstance(value, Enum):
            yield f"{prefix}{f.name}", value, default


def name_rules(cfg, problems) -> None:
    """A string knob set to empty (or blank) where its default is not empty names nothing: `data.input_key=`."""
    from molt_hydra.config.schema import RunConfig

    reported = {line[2:].split(":", 1)[0] for line in problems.lines}
    for key, value, default in _string_fields(cfg, "", RunConfig()):
        if value.strip() or default == "" or key in reported:
            continue
        problems.check(False, key, f"is {value!r}, which names nothing.",
                       f"set {key} to a name" + (f", or {key}=null" if default is None else
                                                  f", or leave it out (default {default!r})"))
    address = cfg.cluster.ray_address
    if address is not None and address.strip() and address not in ("auto", "local"):
        try:
            parts = urlsplit(address if "://" in address else f"ray://{address}")
            ok = parts.scheme in ("ray", "http", "https") and bool(parts.hostname) and parts.port is not None
        except ValueError:  # a port out of range or not a number
            ok = False
        problems.check(ok, "cluster.ray_address", f"{address!r} is not an address Ray can join.",
                       "set it to HOST:PORT of a running Ray head (e.g. 10.0.0.1:6379), ray://HOST:10001, auto, or "
                       "null to start a Ray cluster here")


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe(path: str | None) -> bool | None:
    """Whether model.path is a mixture-of-experts model, told from its config without loading weights; None when
    that cannot be told here (a hub id not downloaded)."""
    import json
    from pathlib import Path

    from molt_hydra.models import tiny, tiny_vlm

    if path is None:
        return None
    if path.startswith(tiny.TINY_SCHEME):
        name = path[len(tiny.TINY_SCHEME):]
        config = tiny.tiny_config_dict(name) if name in tiny.TINY_MODELS else (
            tiny_vlm.tiny_config_dict(name) if name in tiny_vlm.TINY_VLM_MODELS else None)
    else:
        try:
            config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return None
    if not isinstance(config, dict):
        return None
    configs = [config, *(c for c in config.values() if isinstance(c, dict))]  # text_config of a VLM
    return any(int(c.get(k) or 0) > 0 for c in configs for k in MOE_KEYS)


def moe_rules(cfg, problems) -> None:
    """Knobs that act on MoE routers only: on a dense model they would fail in the trainer (or change nothing)."""
    if is_moe(cfg.model.path) is not False:
        return
    m, r, p = cfg.model, cfg.rollout, cfg.parallelism
    for key, is_set in (("model.freeze_moe_router", m.freeze_moe_router), ("rollout.routing_replay", r.routing_replay),
                        ("model.gate_precision", m.gate_precision != "float32"),
                        ("model.aux_loss_coef", m.aux_loss_coef != 0),
                        ("rollout.enable_expert_parallel", r.enable_expert_parallel),
                        ("parallelism.moe_reshard_after_forward", p.moe_reshard_after_forward),
                        ("model.moe_experts_impl", m.moe_experts_impl.value != "auto")):
        problems.check(not is_set, key, f"acts on MoE routers, but model.path={m.path} is a dense model (its config "
                       f"has no experts).", f"unset {key}, or set model.path to a mixture-of-experts model")
