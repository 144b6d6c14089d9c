"""`StepEnvRunner`: the framework owns the token loop (Molt §3.4).

Each turn generates over the exact accumulated token ids, hands the decoded action to `Env.step`, and appends the
returned observation as feedback tokens, so a multi-turn episode is one training sample with several action
ranges. Rewards are summed over turns; score and info come from the last turn; `Result.sampling_params` replaces
the sampling of later turns. The sequence never exceeds `max_length`: a turn gets at most the remaining budget,
and feedback that does not fit is cut and marks the episode truncated.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import json
import logging

from molt_hydra.agents.base import (Env, Episode, Result, Runner, Trajectory, apply_sampling_override, image_tokens,
                                    model_images, reward_and_score, seed_agent_rngs, shippable, text_prompt_ids)
from molt_hydra.agents.targets import subclass
from molt_hydra.data.images import to_pil_images
from molt_hydra.rollout.generation import GenerationRequest, TokenGenerator

log = logging.getLogger(__name__)
PROMPT_MEMO = 4096  # distinct prompts remembered per runner (a few batches' worth)


def _turn_seed(seed: int | None, rollout_seed: int | None, turn: int) -> int | None:
    """A turn's sampling seed: the rollout's plus the turn (was: the rollout's every turn, so vLLM drew the same noise
    at each position of every turn, and a turn repeated an earlier one's tokens wherever their distributions were
    alike: the turns were not independent samples of the policy). A seed the Env set (Result.sampling_params): as
    set."""
    return (seed + turn) % 2**63 if seed is not None and seed == rollout_seed else seed


class StepEnvRunner(Runner):
    def __init__(self, env: type[Env] | str, env_kwargs: dict | None = None, image_tokens_per_image: int = 0):
        """`env`: an Env subclass or its import target (see `targets.resolve_target`); a fresh instance per episode
        is built with `env_kwargs`. `image_tokens_per_image`: tokens the engine adds per image when it expands the
        placeholder, reserved from the length budget: a count, or a function of the image (0: the model's count,
        set by the runner process; see `base.image_tokens`)."""
        self.env_cls = subclass(env, Env, "StepEnvRunner needs an Env subclass")
        self.env_kwargs = dict(env_kwargs or {})
        self.image_tokens_per_image = image_tokens_per_image
        self.accepts_images = True  # False for a text-only model (the runner process sets it)
        self.max_images: int | None = None  # the engines' per-prompt limit, data.max_images_per_prompt (likewise)
        self._prompts: dict = {}  # (tokenizer, prompt) -> (text, token ids): see `_prompt_ids`

    def _prompt_ids(self, prompt, tools, tokenizer) -> tuple[str, list[int]]:
        """The first model input as text and token ids. Chat messages are rendered here, so datasets may hand either
        form; an Env's reset may declare its own tools. A group's samples share their prompt, so each distinct one
        is rendered and tokenized once (plain-JSON prompts only: their text is a function of what the key holds)."""
        try:
            key = (id(tokenizer), prompt if isinstance(prompt, str) else json.dumps([prompt, tools], sort_keys=True))
        except TypeError:  # not plain JSON (an image object, say): no key that is safe to share
            key = None
        found = self._prompts.get(key)
        if found is None:
            if isinstance(prompt, str):  # sent as it is, with the BOS a model's tokenizer adds
                found = (prompt, text_prompt_ids(tokenizer, prompt))
            else:
                text = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
                found = (text, tokenizer(text, add_special_tokens=False)["input_ids"])
            if key is not None:
                if len(self._prompts) >= PROMPT_MEMO:
                    del self._prompts[next(iter(self._prompts))]  # the oldest
                self._prompts[key] = found
        return found[0], list(found[1])

    async def execute(self, episode: Episode, generator: TokenGenerator, tokenizer) -> list[Trajectory]:
        seed_agent_rngs(episode.sampling.seed, "reset")  # the env's construction and reset
        env = self.env_cls(**self.env_kwargs)
        label = copy.deepcopy(episode.label)  # the env's own: the group's rollouts share the row's
        traj, observation_text = await self._first_prompt(env, episode, label, tokenizer)
        images, sampling = list(episode.images), episode.sampling
        for turn in itertools.count():
            max_tokens = min(sampling.max_tokens, episode.max_length - len(traj.token_ids) - self._image_tokens(images))
            if episode.max_turns is not None and turn >= episode.max_turns or max_tokens <= 0:
                traj.truncated = True
                break
            turn_sampling = dataclasses.replace(sampling, n=1, max_tokens=max_tokens, seed=_turn_seed(
                sampling.seed, episode.sampling.seed, turn), min_tokens=min(sampling.min_tokens, max_tokens))
            request = GenerationRequest(episode.rollout_id, list(traj.token_ids), turn_sampling, list(images))
            (gen,) = await generator.generate(request)
            traj.append_action(gen)
            traj.truncated |= gen.finish_reason == "length"
            action_text = tokenizer.decode(gen.token_ids, skip_special_tokens=False)
            observation_text += action_text
            seed_agent_rngs(episode.sampling.seed, "step", turn)
            # the tokenizer, e.g. for vLLM's tool parsers (agents.tool_parser.reply_parser)
            result = await env.step({"observation_text": observation_text, "action_text": action_text,
                                     "action_ids": list(gen.token_ids), "label": label,
                                     "sampling_params": turn_sampling, "turn": turn, "tokenizer": tokenizer})
            self._score(traj, result)
            overridden = apply_sampling_override(sampling, result.sampling_params)
            if overridden.seed == turn_sampling.seed != sampling.seed:  # the turn's own seed handed back (the Env
                # replaced other fields of its state's sampling_params): not one it chose, so later turns go on past it
                overridden = dataclasses.replace(overridden, seed=sampling.seed)
            sampling = overridden
            # no trailing feedback after the last turn: nothing after it would be trained on
            if result.terminated or traj.truncated or not self._feedback(traj, result, images, episode, tokenizer,
                                                                        turn):
                break
            observation_text += result.observation
        shippable(traj.info, f"{self.env_cls.__name__}.step")  # the last turn's: the one the trajectory keeps
        return [traj]

    def _image_tokens(self, images: list) -> int:
        return image_tokens(self.image_tokens_per_image, images)

    async def _first_prompt(self, env: Env, episode: Episode, label, tokenizer) -> tuple[Trajectory, str]:
        """The env's reset observation as the trajectory's first feedback (left-truncated to leave room for one
        generation), and its text. reset gets copies: an env that edits its chat messages in place (a system message
        inserted) would otherwise edit the prompt of every later rollout of its group."""
        prompt = episode.prompt
        if episode.apply_chat_template and isinstance(prompt, str):  # Molt: a string is the user's one message
            prompt = [{"role": "user", "content": prompt}]
        state = env.reset({"observation": copy.deepcopy(prompt), "label": label})
        if inspect.isawaitable(state):
            state = await state
        if not isinstance(state, dict) or not isinstance(state.get("observation"), (str, list)):
            got = f"a dict whose 'observation' is {type(state.get('observation')).__name__}" if isinstance(
                state, dict) else type(state).__name__
            raise TypeError(f"{self.env_cls.__name__}.reset must return a dict with 'observation' (the prompt text "
                            f"or chat messages), got {got}; return the state it was given, changed")
        prompt, ids = self._prompt_ids(state["observation"], state.get("tools", episode.tools), tokenizer)
        if not ids:  # (was: the engine's "session ...: empty prompt_ids", naming neither the row nor the env)
            raise ValueError(f"the first prompt of {self.env_cls.__name__} is empty text (the row's prompt, or what "
                             "reset returned as 'observation'): nothing to generate from. Fix: give the row a prompt, "
                             "or set data.apply_chat_template=true to render it as a user message")
        self._check_image_places(ids, len(episode.images), tokenizer, f"the first prompt of {self.env_cls.__name__} "
                                 "(the row's prompt, or what reset returned) holds",
                                 f"for the row's {len(episode.images)} image(s)",
                                 "the prompt for each of the row's images (an <image> marker or an image part)")
        max_initial = max(1, episode.max_length - episode.sampling.max_tokens - self._image_tokens(episode.images))
        if len(ids) > max_initial:
            if episode.images:  # cutting could split an image's placeholder tokens
                raise ValueError(f"prompt with images has {len(ids)} tokens > {max_initial} allowed by max_length")
            log.warning("rollout %s: prompt left-truncated %d -> %d tokens", episode.rollout_id, len(ids), max_initial)
            bos = [ids[0]] if ids[0] == tokenizer.bos_token_id and max_initial > 1 else []  # kept: its model's first
            ids = bos + ids[len(ids) - max_initial + len(bos):]  # token (text_prompt_ids), cut or not
            prompt = tokenizer.decode(ids, skip_special_tokens=False)
        traj = Trajectory(prompt=episode.prompt, label=episode.label, images=list(episode.images))
        traj.append_feedback(ids)
        return traj, prompt

    @staticmethod
    def _check_image_places(ids: list[int], images: int, tokenizer, what: str, for_images: str, where: str) -> None:
        """Each image placeholder in a prompt's or an observation's tokens is an image's place, as the chat server's
        400 tells a request's text: checked here, on text no completion is part of (the engine's check, over a whole
        multi-turn prompt, runs for requests with images only, where a placeholder the model sampled is its error).
        Was: a place with no image went to the engine as text and was trained on; with images, the engine's refusal
        a turn later named a session id."""
        placeholder = model_images(tokenizer.name_or_path)[1]
        if placeholder is not None and (places := ids.count(placeholder)) != images:
            token = tokenizer.convert_ids_to_tokens(placeholder)
            raise ValueError(f"{what} {places} of this vision model's image placeholder {token!r} {for_images}; the "
                             f"model reads each as an image's place. Fix: write one {token!r} into {where}, and none "
                             "otherwise")

    def _score(self, traj: Trajectory, result: Result) -> None:
        reward, traj.score = reward_and_score(result, f"{self.env_cls.__name__}.step")
        traj.reward += reward  # summed over turns (Molt §3.4)
        traj.info = dict(result.info)
        traj.truncated |= bool(result.truncated)

    def _feedback(self, traj: Trajectory, result: Result, images: list, episode: Episode, tokenizer,
                  turn: int) -> bool:
        """Append the observation (and its images) as feedback; False when it does not fit (cut, truncated)."""
        feedback = tokenizer(result.observation, add_special_tokens=False)["input_ids"]
        new_images = list(result.images or [])
        if new_images and not self.accepts_images:  # the engine cannot see them; training would carry them
            raise ValueError(f"{self.env_cls.__name__}.step returned {len(new_images)} Result.images, but the model "
                             "is text-only; return images only with a vision model (leave Result.images None)")
        self._check_image_places(feedback, len(new_images), tokenizer, f"{self.env_cls.__name__}.step (turn {turn}) "
                                 f"returned an observation holding", f"for its {len(new_images)} Result.images",
                                 "Result.observation for each of Result.images")
        # decoded as a row's images are (a path, bytes, a datasets Image struct; RGB): was, for a path, the
        # processor's "Invalid image type: <class 'str'>", naming neither the env nor the field
        new_images = to_pil_images(new_images, len(new_images), f"Result.images of {self.env_cls.__name__}.step")
        if self.max_images is not None and len(images) + len(new_images) > self.max_images:
            # (was: vLLM's own error out of the engine, naming neither the env nor the key), as the chat server's
            raise ValueError(f"{self.env_cls.__name__}.step returned {len(new_images)} Result.images: "
                             f"{len(images) + len(new_images)} images in the episode > data.max_images_per_prompt="
                             f"{self.max_images}, the engines' per-prompt image limit (every turn's prompt carries all "
                             "earlier images). Fix: return fewer images, or raise data.max_images_per_prompt")
        room = episode.max_length - len(traj.token_ids) - self._image_tokens(images + new_images)
        if len(feedback) >= room:  # not even one token left to generate after it
            traj.append_feedback(feedback[: max(0, room)] if not new_images else [])
            traj.truncated = True
            return False
        traj.append_feedback(feedback)
        images.extend(new_images)
        traj.images = list(images)
        return True
