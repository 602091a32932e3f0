"""The orchestrator's settings, read once from its Triton model parameters (``model_repository/orchestrator/
config.pbtxt``; docs/deployment.md lists them)."""
from __future__ import annotations

from dataclasses import dataclass

from backends.runtime.families import ServedModel
from backends.triton.triton_io import choice_value, float_parameter, int_parameter
from orchestrator.budget_policy import PolicyConfig, SloTargets
from orchestrator.decode_pace import Joins
from orchestrator.fewer_sms import DEFAULT_KINDS, kinds_parameter
from orchestrator.generation_defaults import GenerationDefaults, generation_defaults
from orchestrator.inputs import InputLimits
from orchestrator.media import media_defaults
from orchestrator.prefix_cache import CacheConfig
from orchestrator.reply_limit import DEFAULT_MAX_TOKENS
from orchestrator.sampling_params import RequestParams
from orchestrator.scheduler import SchedulerConfig
from orchestrator.served_template import load_chat_template


@dataclass(frozen=True)
class OrchestratorConfig:
    """From the orchestrator's model parameters. ``max_share`` (default 0.5): while several requests want a
    step's encode or prefill budget, each first gets at most this share of it (``SchedulerConfig``), so a long
    video's prefill cannot hold a short request back; a lone request still uses the whole budget.
    ``short_prefill_tokens`` (default 512, 0 off): prefills that end their prompts within this many tokens go ahead
    of other work in short steps of their own (``SchedulerConfig``, ``orchestrator.step_fill``); ``burst_wait_ms``
    (default 0, off): how long a step may wait for the rest of a burst of requests (``orchestrator.burst``);
    ``idle_budget_scale`` (default 1, off): both budgets' factor in a step planned while nothing decodes;
    ``decode_pace_ms`` (default 0, off): the spacing of decode's steps while a step that ends image prompts, or
    more prompts than decode holds, runs, at most the decoding modalities' TBT targets (``orchestrator.decode_pace``);
    ``fewer_sms_kinds``: the modalities whose steps may run on fewer SMs beside decode (``orchestrator.fewer_sms``);
    ``joins`` (``orchestrator.decode_pace.Joins``), from ``serial_joins`` (``on``/``off``, default off: decode runs
    its steps one at a time while a step ends prompts beside it, so their sequences join its next launch) and
    ``hold_joins`` (``on``/``off``, default on: decode waits out a step of text prompts while most of its requests,
    and at least ``decode_pace.HOLD_MIN_JOINING``, have had no token from it yet).
    ``max_model_len``: prompt + output tokens per request; ``default_max_tokens``: the most output tokens of a request
    that sends ``max_tokens`` null (the OpenAI API's chat without it: ``orchestrator.reply_limit``);
    ``generation``: the checkpoint's generation_config.json defaults (sampling values of requests that do not send
    them, a cap on ``default_max_tokens``) unless the parameter ``generation_config`` is ``none``
    (``orchestrator.generation_defaults``);
    ``replicas``: encode_prefill/decode replicas to drive (``backends/triton/replicas.py``);
    ``max_waiting_requests``: requests that may wait for KV pages at once (over all replicas); a request arriving
    beyond them is refused at once as overloaded (UNAVAILABLE) instead of queueing without bound.
    ``slo_scheduling``: each step's budgets set by ``orchestrator.budget_policy`` from the ``slo`` targets and
    ``policy`` (off: the fixed budgets; off by default until measured against them on the H200);
    ``cache``: the prefix cache (``orchestrator.prefix_cache.CacheConfig``);
    ``model``: the served model (``backends.runtime.families.ServedModel``: its config.json, read once here), whose
    family's media rules, prompt text and tokenizer the orchestrator uses; ``media_defaults``: the server's media
    settings a request's own override (``orchestrator.media.media_defaults``); ``chat_template``: the server's chat
    template, None for the checkpoint's (``orchestrator.served_template``); ``content_format``: how the template takes
    a message's content, ``auto``, ``openai`` or ``string`` (``orchestrator.content_format``)."""

    scheduler: SchedulerConfig
    limits: InputLimits
    max_model_len: int
    model: ServedModel
    replicas: int = 1
    max_waiting_requests: int = 256
    slo_scheduling: bool = False
    slo: SloTargets = SloTargets()
    policy: PolicyConfig = PolicyConfig()
    cache: CacheConfig = CacheConfig()
    media_defaults: RequestParams = RequestParams()
    decode_pace_ms: int = 0
    fewer_sms_kinds: frozenset[str] = DEFAULT_KINDS
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    generation: GenerationDefaults = GenerationDefaults()
    joins: Joins = Joins()
    chat_template: str | None = None
    content_format: str = "auto"

    @property
    def reply_cap(self) -> int:
        """The most output tokens of a request that sends ``max_tokens`` null: ``default_max_tokens``, at most the
        checkpoint's ``max_new_tokens`` (tokens)."""
        return min(self.default_max_tokens, self.generation.max_new_tokens or self.default_max_tokens)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "OrchestratorConfig":
        try:
            share = float(params.get("max_share", "0.5"))
        except ValueError:
            raise ValueError(f"parameter max_share must be a number in (0, 1], got {params['max_share']!r}") from None
        model = ServedModel.read(params.get("preset") or "tiny", params.get("model_path") or None)
        # empty or absent: the served family's defaults (its Family.budgets)
        budgets = model.family.budgets
        given = {key: value for key, value in params.items() if value.strip()}
        scheduler = SchedulerConfig(encode_budget=int_parameter(given, "encode_budget", budgets.encode),
                                    prefill_budget=int_parameter(given, "prefill_budget", budgets.prefill),
                                    max_share=share,
                                    short_prefill_tokens=int_parameter(given, "short_prefill_tokens", 512),
                                    burst_wait_ms=int_parameter(given, "burst_wait_ms", 0),
                                    idle_budget_scale=int_parameter(given, "idle_budget_scale", 1))
        switch = params.get("slo_scheduling", "false").strip().lower()
        if switch not in ("true", "false"):
            raise ValueError(f"parameter slo_scheduling must be true or false, got {params['slo_scheduling']!r}")
        return cls(scheduler, InputLimits.from_parameters(params), int_parameter(params, "max_model_len", 32768),
                   model, int_parameter(params, "replicas", 1),
                   int_parameter(params, "max_waiting_requests", cls.max_waiting_requests), switch == "true",
                   SloTargets.from_parameters(params),
                   PolicyConfig(float_parameter(params, "decode_priority_boost", PolicyConfig.decode_priority_boost)),
                   CacheConfig.from_parameters(params), media_defaults(params.get("media_defaults"), model.family),
                   int_parameter(given, "decode_pace_ms", 0), kinds_parameter(params),
                   int_parameter(given, "default_max_tokens", DEFAULT_MAX_TOKENS),
                   generation_defaults(model.model_path, given.get("generation_config", "auto").strip()),
                   Joins(*(choice_value(name, given.get(name, "on" if default else "off").strip()) == "on"
                           for name, default in (("serial_joins", Joins.serial), ("hold_joins", Joins.hold)))),
                   load_chat_template(params.get("chat_template", "")),
                   choice_value("chat_template_content_format", given.get("chat_template_content_format", "auto")))
