"""Validation rules for `agent.runner`: its `_target_` names an Env, ChatAgent or Runner, and its kwargs bind to the
constructors they reach (built once here, so their own checks run before anything starts); and for what the agents
are handed: each local dataset's prompts as the chat server takes them. Run by runtime/validate.py beside
config/validate.py's rules."""

from __future__ import annotations

import difflib
import inspect
import os
import re
from collections.abc import Mapping, Sequence

from molt_hydra.agents.base import Env, Runner
from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner, row_image_part
from molt_hydra.agents.loading import HYDRA_KEYS, resolve_target
from molt_hydra.agents.step_runner import StepEnvRunner
from molt_hydra.agents.wire import openai_chat
from molt_hydra.agents.wire.images import image_sources, load_image
from molt_hydra.agents.wire.request import RequestError
from molt_hydra.config.bounds import get
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import Problems, changed
from molt_hydra.data.prompts import (BUILTIN, BUILTIN_TASKS, IMAGE_FIX, IMAGE_PART_FIX, PROMPT_FIX, builtin_size,
                                     check_prompt_rows, combined, own_image_part, unfound_image)
from molt_hydra.data.rules import raised, readable_local
from molt_hydra.models.rules import has_chat_template

TARGET_FIX = "set agent.runner._target_ to pkg.module.Name or path/to/file.py:Name (an Env, ChatAgent or Runner)"


def _target(problems: Problems, runner) -> type | None:
    """The class `agent.runner._target_` names, or None (reported) when it names none."""
    target = runner.get("_target_") if hasattr(runner, "get") else None
    if not isinstance(target, str) or not target:
        problems.check(False, "agent.runner._target_", f"the agent has no _target_ (keys {sorted(runner)}).",
                       TARGET_FIX)
        return None
    try:
        obj = resolve_target(target)
    except SystemExit as e:  # a script's top-level sys.exit() / argparse (was: the CLI ended with its code and text)
        problems.check(False, "agent.runner._target_", f"importing {target!r} called sys.exit({e.code!r}): the file "
                       "runs code meant for a script when imported.", "put that code (argparse, sys.exit) under "
                       "`if __name__ == '__main__':`, and pass settings as agent.runner.* kwargs")
        return None
    except Exception as e:  # noqa: BLE001 -- any failure to import user code is a config error here
        problems.check(False, "agent.runner._target_", f"cannot import {target!r} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200] if str(e) else ''}).", _local_module_fix(target, e))
        return None
    ok = isinstance(obj, type) and issubclass(obj, (Runner, Env, ChatAgent))
    problems.check(ok, "agent.runner._target_", f"{target!r} is {obj!r}, not an Env, ChatAgent or Runner subclass.",
                   TARGET_FIX)
    return obj if isinstance(obj, type) else None


def _local_module_fix(target: str, error: Exception) -> str:
    """The fix for a target that did not import: where its dotted path names a module file of the working directory
    (`my_agents.MyEnv` beside my_agents.py), which is not on the import path of `molt-run` (nor of the agent runners),
    that file's target (was: the generic fix alone, the user left to guess why a file they can see was not found)."""
    module, _, name = target.rpartition(".")
    missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if missing and module and (module == missing or module.startswith(missing + ".")):
        file = module.replace(".", os.sep) + ".py"
        if os.path.isfile(file):
            return (f"name it by its file, agent.runner._target_={file}:{name} ({missing} is not on the import path "
                    "here), or install its package")
    return TARGET_FIX


def _nested_targets(problems: Problems, cls: type, value, key: str, seen: set[int]) -> None:
    """A kwarg holding its own `_target_` (Hydra's nested instantiation) is passed to the agent as the dict it is: the
    loader builds the agent.runner target alone. Was: taken, and every rollout failed inside the agent on the dict
    (`'dict' object has no attribute 'grade'`); refused here, naming the key, unless agent.runner._recursive_=false
    (Hydra's own switch) says the agent builds it. `seen`: containers already walked (a value that holds itself)."""
    if id(value) in seen or isinstance(value, (str, bytes)):
        return
    seen.add(id(value))
    if isinstance(value, Mapping):  # (a dict, an OmegaConf DictConfig)
        if "_target_" in value:
            problems.check(False, key, f"holds a '_target_' ({value['_target_']!r}), but the agent's kwargs reach "
                           f"{cls.__name__} as they are: it would get this dict, not the object it names (only "
                           "agent.runner._target_ is built).", f"give {cls.__name__} the class as a string kwarg and "
                           "its settings as plain kwargs, and build the object in its constructor "
                           "(molt_hydra.agents.targets.resolve_target resolves the string); or, where the agent "
                           "builds it from the dict itself (hydra.utils.instantiate), set agent.runner._recursive_="
                           "false, Hydra's switch for passing it as it is")
            return
        for name, inner in value.items():
            _nested_targets(problems, cls, inner, f"{key}.{name}", seen)
    elif isinstance(value, Sequence):  # (a list, an OmegaConf ListConfig)
        for at, inner in enumerate(value):
            _nested_targets(problems, cls, inner, f"{key}[{at}]", seen)


def _kwarg_problems(problems: Problems, cls, kwargs: dict) -> None:
    """Bind kwargs to `cls`'s constructor as `cls(**kwargs)` would; report each unknown or missing one by its key."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to bind against
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for name in sorted(set(kwargs) - set(named)):
            near = difflib.get_close_matches(name, [*named, "_target_"], n=1)  # +agent.runner.target: _target_
            problems.check(False, f"agent.runner.{name}", f"{cls.__name__}({', '.join(named)}) takes no argument "
                           f"{name!r}" + (f" (did you mean {near[0]!r}?)." if near else "."),
                           f"remove +agent.runner.{name}" + (f" or spell it agent.runner.{near[0]}" if near else ""))
    for name, p in params.items():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and name not in kwargs:
            problems.check(False, f"agent.runner.{name}", f"{cls.__name__} needs it and it is not set.",
                           f"add +agent.runner.{name}=VALUE")


def _chat_settings_read(cfg: RunConfig, problems: Problems, cls: type) -> None:
    """agent.tool_parser and max_choices configure the chat server of a ChatAgent (the runner's `configure_chat`); an
    Env's step runner, or a Runner without it, reads neither. (reasoning_parser also reaches the engines: an Env's
    structured sampling waits for the end of the thinking too.)"""
    runner = StepEnvRunner if issubclass(cls, Env) else ChatAgentRunner if issubclass(cls, ChatAgent) else cls
    if hasattr(runner, "configure_chat"):
        # and the reverse: a chat agent's prompt always reaches its server as messages (a string as the user's one
        # message), rendered there with the chat template (was: data.apply_chat_template=false taken, changing nothing)
        problems.check(not (runner.execute is ChatAgentRunner.execute and changed(cfg, "data.apply_chat_template")),
                       "data.apply_chat_template", f"the agent {cls.__name__} is a ChatAgent: each prompt reaches its "
                       "chat server as chat messages (a string as the user's one message), which the server renders "
                       "with the chat template whatever this says.", "unset data.apply_chat_template (false sends an "
                       "Env's string prompts to the model as raw text)")
        return
    for key in ("agent.tool_parser", "agent.max_choices"):
        problems.check(not changed(cfg, key), key, f"the agent {cls.__name__} talks to no chat server (not a "
                       "ChatAgent), and nothing else reads it.", f"unset {key} (it configures ChatAgent agents)")


# The methods each kind of agent class implements, the arguments its runner passes, and whether it awaits them.
CALLED = ((Env, "step", "state", True), (Env, "reset", "state", False), (ChatAgent, "run", "ctx", True),
          (Runner, "execute", "episode, generator, tokenizer", True))


def _runner_calls_fit(problems: Problems, cls: type) -> None:
    """A plain `def step` / `run` / `execute` fails every rollout ("object Result can't be used in 'await'
    expression"), and so does one whose parameters do not take the runner's arguments (`async def step(self)`:
    "takes 1 positional argument but 2 were given"), or one that yields its Result: refused here, naming the method
    and the fix. A plain decorator's wrapper (functools.wraps) of an `async def` returns its coroutine: taken (was:
    refused as "a plain function", telling the author to write the `async def` they had written)."""
    for base, name, args, awaited in CALLED:
        if not issubclass(cls, base):
            continue
        method = getattr(cls, name, None)
        if name in getattr(cls, "__abstractmethods__", ()):  # (was, a Runner's: passed, its runners failed to start;
            # an Env's / ChatAgent's: "Can't instantiate abstract class", told to fix the agent.runner kwargs)
            problems.check(False, "agent.runner._target_", f"{cls.__name__} does not define {name}, which the runner "
                           f"calls (the {base.__name__} contract).",
                           f"define `{'async def' if awaited else 'def'} {name}(self, {args})` in {cls.__name__}")
            continue
        if not callable(method):  # (a property, a value, None: was a TypeError traceback out of validation)
            problems.check(False, "agent.runner._target_", f"{cls.__name__}.{name} is a {type(method).__name__}, "
                           f"not a method, but the runner calls it (the {base.__name__} contract).",
                           f"declare it `{'async def' if awaited else 'def'} {name}(self, {args})`")
            continue
        # a decorator's wrapper is judged with what it wraps: an async wrapper of a plain `def` (asyncio.to_thread)
        # is awaitable, and so is a plain wrapper (functools.wraps) of an `async def`
        inner, coroutine = inspect.unwrap(method), inspect.iscoroutinefunction(method)
        if awaited and not coroutine and (inspect.isasyncgenfunction(inner) or inspect.isgeneratorfunction(inner)):
            problems.check(False, "agent.runner._target_", f"{cls.__name__}.{name} yields (a generator), but the "
                           f"runner awaits one {'Result' if base is not Runner else 'list of Trajectory'} from it.",
                           f"`return` it from `async def {name}(...)` instead of yielding")
        elif awaited and not (coroutine or inspect.iscoroutinefunction(inner)):
            problems.check(False, "agent.runner._target_", f"{cls.__name__}.{name} is a plain function, but the "
                           f"runner awaits it (the {base.__name__} contract: `async def {name}`).",
                           f"declare it `async def {name}(...)` (blocking work inside it: "
                           "`await asyncio.to_thread(fn, ...)`)")
        bound = isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod))  # no self to pass
        try:
            inspect.signature(method).bind(*([] if bound else [None]), *args.split(", "))
        except TypeError as e:
            problems.check(False, "agent.runner._target_", f"{cls.__name__}.{name}{inspect.signature(method)} "
                           f"cannot take the runner's call {name}({args}): {e}.",
                           f"declare it `{'async def' if awaited else 'def'} {name}(self, {args})`")
        except ValueError:  # a builtin without a signature: nothing to bind against
            pass


def check_agent(cfg: RunConfig, problems: Problems) -> None:
    """`agent.runner`'s kwargs against the constructors they reach: the Runner's, then the Env / ChatAgent's that a
    StepEnvRunner / ChatAgentRunner builds per rollout (built once here too, so its own checks run now)."""
    if cfg.job.value == "sft":  # SFT runs no agent
        return
    cls = _target(problems, cfg.agent.runner)
    # resolved once, here (was twice: an agent file whose import fails ran its top-level code twice)
    chat = isinstance(cls, type) and issubclass(cls, (ChatAgent, ChatAgentRunner))
    templated, texts = check_prompts(cfg, problems, chat=chat)
    if chat or isinstance(cls, type) and issubclass(cls, (Env, StepEnvRunner)):  # (a Runner of its own: its choice)
        _template_needed(cfg, problems, templated, chat)
        _raw_text_read(cfg, problems, cls, texts)
    if cls is None:
        return
    _chat_settings_read(cfg, problems, cls)
    spec, before = {k: v for k, v in cfg.agent.runner.items() if k not in HYDRA_KEYS}, len(problems.lines)
    recursive = cfg.agent.runner.get("_recursive_", True)
    problems.check(isinstance(recursive, bool), "agent.runner._recursive_", f"is {recursive!r}, not a boolean.",
                   "set it to false (nested _target_ dicts reach the agent as they are) or leave it out")
    if recursive is True:
        _nested_targets(problems, cls, spec, "agent.runner", set())
    _kwarg_problems(problems, cls, spec)
    if len(problems.lines) > before:
        return
    _runner_calls_fit(problems, cls)
    if issubclass(cls, (StepEnvRunner, ChatAgentRunner)):
        # both only store their arguments (and resolve the env / agent they name); a subclass may do more
        if (runner := _built(problems, cls, spec)) is None:
            return
        cls, spec = (runner.env_cls, runner.env_kwargs) if isinstance(runner, StepEnvRunner) else (
            runner.agent_cls, runner.agent_kwargs)
        _kwarg_problems(problems, cls, spec)
        _runner_calls_fit(problems, cls)
    if len(problems.lines) == before and issubclass(cls, (Env, ChatAgent)) and not issubclass(cls, Runner):
        _built(problems, cls, spec)


def _built(problems: Problems, cls: type, spec: dict):
    """`cls(**spec)`, or None where its constructor raises (user code: whatever it refuses is a config error, named;
    was, for a StepEnvRunner / ChatAgentRunner subclass, a traceback out of validation)."""
    try:
        return cls(**spec)
    except SystemExit as e:  # an env / agent file it imports exits (a script's argparse): as `_target`
        problems.check(False, "agent.runner._target_", f"building {cls.__name__} called sys.exit({e.code!r}): a file "
                       "it imports runs code meant for a script.", "put that code (argparse, sys.exit) under "
                       "`if __name__ == '__main__':`, and pass settings as agent.runner.* kwargs")
        return None
    except Exception as e:  # noqa: BLE001
        text = str(e).splitlines()[0][:300] if str(e) else ""
        named = re.match(r"(agent\.runner\.\w+): (.*) Fix: (.*)", text)  # already "key: reason Fix: fix"
        key, reason, fix = named.groups() if named else ("agent.runner", text, "fix the agent.runner.* kwargs")
        problems.check(False, key, f"{cls.__name__}(**agent.runner kwargs) raised {type(e).__name__}: "
                       f"{reason.rstrip('.')}.", fix)
        return None


EVAL_COLUMNS_FIX = ("give eval.data_path's rows the training data's column names (both are read with data.input_key, "
                    "data.label_key, data.tools_key and data.image_key), e.g. rename its columns")


def check_prompts(cfg: RunConfig, problems: Problems, chat: bool) -> tuple[dict[str, str], dict[str, bool | None]]:
    """Each local RL dataset's rows as the run will load them (data/prompts.py), their prompts as the chat server
    will take them: a message of another role or a number for content, an image part whose file is not there or
    beyond data.max_images_per_prompt (was: a 400 for each rollout of the row, every epoch, once Ray had started),
    and for a `chat` agent their tools too (its server's parser refuses other shapes; an Env's tools reach the chat
    template as they are, where any shape renders). Hub datasets are read at the run's start. Then the count of the
    training rows against rollout.batch_size (`_fills_a_batch`). Run by `check_agent`, which knows the agent.
    Returns {data key: its first row the chat template renders} (a chat agent's any row; an Env's chat messages, or
    text under data.apply_chat_template; a builtin task's rows are messages) for `_template_needed`, and {data key:
    whether a row of it is text; None: not known here (a hub dataset, or rows refused)} for `_raw_text_read`."""
    d, sizes, templated, texts = cfg.data, {}, {}, {}  # sizes: (key, dataset) -> row count, of readable local data
    for key, spec, split, config in (("data.train_path", d.train_path, d.split, d.config_name),
                                     ("eval.data_path", cfg.eval.data_path, cfg.eval.split, cfg.eval.config_name)):
        for part in (p.strip() for p in (spec or "").split(",") if p.strip().startswith(BUILTIN)):
            templated.setdefault(key, f"{part} (chat messages)")
            texts.setdefault(key, False)
        if any(p.strip() and not (p.strip().startswith(BUILTIN) or readable_local(p.strip()))
               for p in (spec or "").split(",")):
            texts[key] = None  # (a hub dataset: read at the run's start)
        for part in (p.strip() for p in (spec or "").split(",") if readable_local(p.strip())):
            texts.setdefault(key, False)
            try:
                rows = check_prompt_rows(part, split, config, input_key=d.input_key, label_key=d.label_key,
                                         tools_key=d.tools_key, image_key=d.image_key)
                at = next((i for i, row in enumerate(rows) if chat or d.apply_chat_template
                           or not isinstance(row["prompt"], str)), None)
                if at is not None:
                    kind = "text" if isinstance(rows[at]["prompt"], str) else "chat messages"
                    templated.setdefault(key, f"{part} row {at} ({kind})")
                for i, row in enumerate(rows):
                    tools = row.get("tools") if chat else None
                    if (problem := _prompt_problem(row["prompt"], d.max_images_per_prompt, tools, chat)):
                        column, value = ("tools_key", row["tools"]) if problem[0].startswith("tools") else (
                            "input_key", row["prompt"])
                        raise ValueError(f"{part} row {i}: data.{column}={getattr(d, column)!r} is {value!r:.60}; "
                                         f"{problem[0]}. Fix: {problem[1]}")
                if d.image_key and d.max_images_per_prompt and (gone := unfound_image(rows)):
                    raise ValueError(f"{part}: every row with images has one that is not there, e.g. {gone!r} "
                                     f"(data.image_key={d.image_key!r}); each would be dropped. Fix: "
                                     + IMAGE_FIX.format(cwd=os.getcwd()))
                sizes[key, part] = len(rows)
                if texts[key] is False:
                    texts[key] = any(isinstance(row["prompt"], str) for row in rows)
            except (KeyError, OSError, ValueError) as e:
                if isinstance(e, KeyError) and key == "eval.data_path" and cfg.job.value != "eval" and any(
                        p.strip() and not p.strip().startswith(BUILTIN) for p in (d.train_path or "").split(",")):
                    # a missing column (data/prompts.py _renamed): its data.* key also reads the training data's
                    # columns, so setting it to eval's breaks those (was: the fix named the key alone, sending the
                    # user from one data's error to the other's)
                    e = KeyError(f"{e.args[0].partition(' Fix: ')[0]} Fix: {EVAL_COLUMNS_FIX}")
                raised(problems, key, e, f"point {key} at a readable dataset")
                texts[key] = None
    _fills_a_batch(cfg, problems, sizes)
    return templated, texts


def _raw_text_read(cfg: RunConfig, problems: Problems, cls: type, texts: dict[str, bool | None]) -> None:
    """data.apply_chat_template=false sends an Env's text prompts to the model as they are; chat messages are rendered
    with the chat template whatever it says (step_runner.py). Data of chat messages alone (every builtin task) took
    it, changing nothing (Molt refuses a list prompt without it). A ChatAgent's: `_chat_settings_read`."""
    texts = {k: v for k, v in texts.items() if cfg.job.value != "eval" or k == "eval.data_path"}
    runner = StepEnvRunner if issubclass(cls, Env) else cls  # (one of its own first prompt: its choice)
    if not (getattr(runner, "_first_prompt", None) is StepEnvRunner._first_prompt
            and changed(cfg, "data.apply_chat_template") and texts and all(v is False for v in texts.values())):
        return
    keys = " and ".join(f"{key}={get(cfg, key)}" for key in texts)
    problems.check(False, "data.apply_chat_template", f"every prompt of {keys} is chat messages, which the step "
                   "runner renders with the chat template whatever this says; it sends text prompts alone as they "
                   "are, and there are none.", "unset data.apply_chat_template, or give the prompts as text")


def _template_needed(cfg: RunConfig, problems: Problems, templated: dict[str, str], chat: bool) -> None:
    """Prompts the agent renders with the chat template (`check_prompts`' `templated`) on a tokenizer without one: every
    rollout failed at run time, each with transformers' "Cannot use chat template functions" (was: the rows'
    template check at load was skipped for such a tokenizer, leaving it to the runners). A hub tokenizer not
    downloaded cannot be told here (models/rules.py has_chat_template: None), and is left to the runners still."""
    tokenizer = cfg.model.tokenizer_path or cfg.model.path
    templated = {k: v for k, v in templated.items() if cfg.job.value != "eval" or k == "eval.data_path"}
    if not templated or has_chat_template(tokenizer) is not False:
        return
    which = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    text = ("" if chat else ", or give the prompts as text with data.apply_chat_template=false (an Env's text "
            "prompt then reaches the model as it is)")
    for key, where in templated.items():
        problems.check(False, key, f"{where} is rendered with the chat template{' by the chat agent' * chat}, but the "
                       f"tokenizer of {which}={tokenizer} has none: every rollout would fail.",
                       f"set model.tokenizer_path to a tokenizer with a chat template (or save one into its "
                       f"tokenizer_config.json){text}")


def _fills_a_batch(cfg: RunConfig, problems: Problems, sizes: dict[tuple[str, str], int]) -> None:
    """Training data of fewer rows, as the run loads them (data/prompts.py `combined`), than the rollout.batch_size
    prompts each step takes: its steps would train on a partial batch, or on one prompt twice (the generator runs
    on into the next episode). Was: 1 row and rollout.batch_size=8 trained one step on one group without a word.
    Counted when every dataset's size is known here (builtin tasks, local datasets whose rows passed); a hub dataset
    is read at the run's start. A data.max_samples below the batch: config/validate.py says so."""
    d, b = cfg.data, cfg.rollout.batch_size
    parts = [p.strip() for p in (d.train_path or "").split(",") if p.strip()]
    if cfg.job.value != "rl" or d.max_samples < b or not parts:
        return
    known = {p: builtin_size(p) for p in parts if p.startswith(BUILTIN) and p[len(BUILTIN):] in BUILTIN_TASKS}
    counts = [known.get(p, sizes.get(("data.train_path", p))) for p in parts]
    probs = d.train_probs
    if None in counts or probs is not None and (len(probs) != len(parts) or min(probs) <= 0):  # (reported elsewhere)
        return
    n = len(combined([range(c) for c in counts], d.max_samples, probs, cfg.seed))
    problems.check(n >= b, "data.train_path", f"{d.train_path} has {n} row(s) to train on, fewer than the "
                   f"rollout.batch_size={b} prompts each step takes: a step would train on a partial batch, or hold a "
                   "prompt twice (over several train.num_episodes).", f"set rollout.batch_size <= {n} (raise "
                   "rollout.n_samples_per_prompt to keep the samples per step), or give it more rows")


TOOLS_FIX = ("give each row's tools as OpenAI chat function tools, [{'type': 'function', 'function': {'name': ..., "
             "'parameters': {...}}}, ...], each name once")


def _prompt_problem(prompt, max_images: int, tools: list | None, chat: bool) -> tuple[str, str] | None:
    """(why, fix) where the chat server would refuse `prompt` as a request's messages, with the row's `tools` (its own
    parser, its image loader for each image part, the engines' image limit), or None. (Was: a row's tools in another
    shape, e.g. the Responses API's flat one, or two of one name, passed; a chat agent's every request was a 400.)"""
    if isinstance(prompt, str) and tools is None:
        return None
    # (was, for a chat agent, the parser's "unsupported content part type 'image'"; an Env's step runner reads no
    # image_url part: each rollout failed on an image placeholder without its image)
    if own := own_image_part(prompt, ("image",) if chat else ("image", "image_url")):
        return own[0], (f"write it as {{'type': 'image_url', 'image_url': {{'url': {own[1]!r:.60}}}}} (an image "
                        "file's path or a base64 data: URI), or as a bare {'type': 'image'} part with the row's image "
                        "in the column data.image_key names" if chat else f"{IMAGE_PART_FIX}; an Env's first prompt "
                        "takes no image_url part (a ChatAgent's server does)")
    # a bare {"type": "image"} part is the row's next image, as an `<image>` marker is (prompt_messages)
    body = {"messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        dict(m, content=[{"type": "text", "text": "<image>"} if row_image_part(p) else p for p in m["content"]])
        if m.get("role") == "user" and isinstance(m.get("content"), list) else m for m in prompt]}
    try:
        messages = openai_chat.parse({**body, **({"tools": tools} if tools is not None else {})}).messages
    except RequestError as e:
        return e.message, TOOLS_FIX if e.message.startswith("tools") else PROMPT_FIX
    if len(sources := image_sources(messages)) > max_images:
        return (f"{len(sources)} image parts > data.max_images_per_prompt={max_images}, the engines' per-prompt "
                "limit", "raise data.max_images_per_prompt (a vision-language model), or remove the image parts")
    for at, source in enumerate(sources):
        try:
            load_image(source)
        except RequestError as e:
            return f"image {at}: {e.message}", "give each image_url part an image file's path or a base64 data: URI"
    return None
