"""A checkpoint's generation defaults: every EOS id it declares and the sampling it recommends.

config.json and generation_config.json may both list EOS ids (Llama-3.1-Instruct lists three); any of
them ends a request, as in transformers' generate() and vLLM. Under vLLM's `--generation-config auto`
(the default), generation_config.json's max_new_tokens, temperature, top_p, top_k, min_p and repetition_penalty
replace the fields a request leaves unset (SamplingParams.unset), on every path (the pods fill them
before anything reads max_tokens, LLMEngine.add_request fills the rest); do_sample false there means
greedy, as transformers reads it. max_new_tokens is a default, not a cap, as in vLLM since its PR 34063
(get_max_tokens): a request that names max_tokens keeps it, one that names none gets max_new_tokens
bounded by the room the model's length leaves. `vllm` ignores the file's sampling (its EOS ids still end
requests), as vLLM does. As in vLLM, the mode may also name a folder whose generation_config.json
replaces the model's sampling defaults, and overrides (vLLM's --override-generation-config, in the file's
own field names) are merged over the file's defaults, or are the only ones under `vllm`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.engine.model.checkpoint_json import check_field_types, read_json_object
from shared.engine.request import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# vLLM's --generation-config modes: take the checkpoint's sampling defaults, or ignore them.
GENERATION_CONFIG_AUTO = "auto"
GENERATION_CONFIG_VLLM = "vllm"
GENERATION_CONFIG_CHOICES = (GENERATION_CONFIG_AUTO, GENERATION_CONFIG_VLLM)  # or a folder's path
# The sampling fields a generation_config.json gives requests as defaults (SamplingParams' names too).
_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p")
# The generation_config.json fields requests take defaults from: what an override may set.
OVERRIDABLE_FIELDS = ("max_new_tokens", "do_sample", *_SAMPLING_FIELDS)
# Sampling settings a generation_config.json may recommend that requests do not take from it (typical_p:
# SamplingParams has no such field; the penalties: vLLM does not default them either).
_UNSUPPORTED_SAMPLING = ("typical_p", "presence_penalty", "frequency_penalty")
_MAX_TOKENS_NOTE = " (for requests that name none, within the model's length; not a cap)"
# The JSON types of the fields read from a generation_config.json (or given as overrides).
FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "max_new_tokens": ("integer", "null"),
    "do_sample": ("boolean", "null"),
    "temperature": ("number", "null"),
    "top_p": ("number", "null"),
    "top_k": ("integer", "null"),
    "min_p": ("number", "null"),
    "repetition_penalty": ("number", "null"),
    "eos_token_id": ("integer", "array", "null"),
}
# top_k values that mean "no top-k filter": transformers' 0 and vLLM's -1 (SamplingParams' own is 0).
_TOP_K_OFF = (0, -1)


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()  # the first is the primary EOS; any of them ends a request
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams field -> default

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's defaults, then the given fields on top."""
        return SamplingParams(**{**self.sampling, **overrides})

    def fill(self, params: SamplingParams, room: int | None = None) -> SamplingParams:
        """params with each field it left unset replaced by the checkpoint's default, where there is one.
        room: the output tokens the model's length leaves after the prompt; a filled max_tokens stays
        within it (at least 1, so a prompt that fills the model is refused for its length)."""
        if not params.unset:
            return params
        filled = {name: self.sampling[name] for name in params.unset if name in self.sampling}
        if "max_tokens" in filled and room is not None:
            filled["max_tokens"] = max(1, min(filled["max_tokens"], room))
        return dataclasses.replace(params, **filled, unset=frozenset())

    def describe(self) -> str:
        """The sampling defaults in use, for the start-up log."""
        if not self.sampling:
            return "none (requests' unset fields keep the API defaults)"
        return ", ".join(f"{name}={value}" + (_MAX_TOKENS_NOTE if name == "max_tokens" else "")
                         for name, value in sorted(self.sampling.items()))


def eos_ids(value: Any) -> tuple[int, ...]:
    """An eos_token_id field (None, one id or a list of ids) as a tuple."""
    if value is None:
        return ()
    ids = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for token_id in ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"eos_token_id entries must be non-negative integers, got {value!r}")
    return ids


def generation_defaults(config_eos_token_ids: tuple[int, ...], model_dir: Path | None,
                        mode: str = GENERATION_CONFIG_AUTO,
                        overrides: dict[str, Any] | None = None) -> GenerationDefaults:
    """The EOS ids of config.json merged with generation_config.json's (config.json's first, no repeats),
    and the sampling defaults: the model's file's ("auto"), none ("vllm"), or those of the
    generation_config.json in the folder mode names; overrides on top of them."""
    check_generation_config_mode(mode)
    overrides = check_generation_overrides(overrides or {})
    generation = _read_generation_config(model_dir)
    ids = config_eos_token_ids + eos_ids(generation.get("eos_token_id"))
    if mode == GENERATION_CONFIG_VLLM:
        recommended = {}
    elif mode == GENERATION_CONFIG_AUTO:
        recommended = generation
    else:
        recommended = _read_generation_config(Path(mode))
        ids += eos_ids(recommended.get("eos_token_id"))
    ignored = [name for name in _UNSUPPORTED_SAMPLING if recommended.get(name) not in (None, 1.0, 0.0)]
    if ignored:
        logger.warning("%s recommends %s, which requests do not take from it; they sample without them",
                       GENERATION_CONFIG_FILE, ", ".join(f"{n}={recommended[n]}" for n in ignored))
    sampling = _sampling_defaults({**recommended, **overrides})
    return GenerationDefaults(eos_token_ids=tuple(dict.fromkeys(ids)), sampling=sampling)


def check_generation_config_mode(mode: str) -> None:
    """ValueError unless mode is "auto", "vllm" or a folder holding a generation_config.json."""
    if mode in GENERATION_CONFIG_CHOICES:
        return
    if not (Path(mode) / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"generation_config must be {' or '.join(GENERATION_CONFIG_CHOICES)}, or a folder "
                         f"holding a {GENERATION_CONFIG_FILE}; {mode!r} is neither")


def check_generation_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides, refused by name when a field is not one requests take a default from."""
    unknown = sorted(set(overrides) - set(OVERRIDABLE_FIELDS))
    if unknown:
        raise ValueError(f"generation config overrides: {', '.join(unknown)} cannot be set (the fields "
                         f"requests take defaults from: {', '.join(OVERRIDABLE_FIELDS)})")
    _check_sampling(overrides, f"generation config overrides {overrides}")
    return overrides


def _read_generation_config(folder: Path | None) -> dict[str, Any]:
    """The file's fields, checked: an error names the file and the field."""
    if folder is None or not (folder / GENERATION_CONFIG_FILE).is_file():
        return {}
    path = folder / GENERATION_CONFIG_FILE
    generation = read_json_object(path)
    _check_sampling(generation, str(path))
    return generation


def _check_sampling(generation: dict[str, Any], source: str) -> None:
    """ValueError naming source and the field when a value has the wrong type or is out of range."""
    check_field_types(generation, FIELD_TYPES, source)
    # transformers' GenerationConfig refuses these too, so the checkpoint cannot run as it recommends.
    if generation.get("max_new_tokens") is not None and generation["max_new_tokens"] < 1:
        raise ValueError(f"{source}: max_new_tokens must be >= 1, got {generation['max_new_tokens']}")
    try:
        eos_ids(generation.get("eos_token_id"))
        _sampling_defaults(generation)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    if generation.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(generation["max_new_tokens"])
    # do_sample false: greedy, so of the sampling fields only the penalty still applies.
    names = ("repetition_penalty",) if generation.get("do_sample") is False else _SAMPLING_FIELDS
    for name in names:
        if generation.get(name) is not None:
            defaults[name] = int(generation[name]) if name == "top_k" else float(generation[name])
    if defaults.get("top_k") in _TOP_K_OFF:
        del defaults["top_k"]  # no filter: a request's unset top_k keeps its own (0, off)
    if generation.get("do_sample") is False:
        defaults["temperature"] = 0.0  # greedy, whatever temperature the file also names
    SamplingParams(**defaults)  # a value out of range fails at load, not on the first request
    return defaults
