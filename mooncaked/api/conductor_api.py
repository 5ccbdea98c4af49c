"""The Conductor seen from outside: ``/admin/explain``, its status section and metrics.

``POST /admin/explain`` with ``{"prompt": "text" | [token ids], "max_tokens": n,
"slo": {"ttft_ms": .., "tbt_ms": ..}}`` answers what this node would decide for
that prompt now: every prefill candidate's cached prefix and TTFT terms,
every decode candidate's predicted TBT, and the placement or the rejection
with its reason. Nothing runs and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mooncaked.api.admin import prompt_token_ids
from mooncaked.api.errors import ApiError
from mooncaked.api.limits import BadBody, read_json_object
from mooncaked.api.protocol import parse_slo
from mooncaked.api.refusals import MODEL_LOADING, NotServing, refusal
from mooncaked.api.render import json_response
from mooncaked.api.services import Services
from mooncaked.cache.hashing import block_hashes
from mooncaked.router import RouteError


class ConductorAPI:
    def __init__(self, services: Services) -> None:
        self._services = services
        self._router = services.router

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/admin/explain", self.explain)]

    async def explain(self, request: web.Request) -> web.Response:
        engine = self._services.engine
        if engine is None:
            return refusal(NotServing(MODEL_LOADING, "model_loading")).error.response()
        try:
            body = await read_json_object(request)
            ids = await prompt_token_ids(engine, body)
            max_tokens = body.get("max_tokens", 16)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise BadBody("'max_tokens' must be an integer >= 1")
            slo = parse_slo(body)
        except BadBody as exc:
            return ApiError(400, str(exc)).response()
        except ApiError as exc:
            return exc.response()
        hashes = block_hashes(ids, engine.block_size, engine.model_id)
        try:
            decision = self._router.decide(ids, hashes, max_tokens, slo=slo)
        except RouteError as exc:
            return refusal(exc).error.response()
        doc = decision.to_json()
        doc["prompt_tokens"] = len(ids)
        doc["prompt_blocks"] = len(hashes)
        doc["entry_node"] = self._router.node_id
        doc["slo"] = {
            "ttft_s": (slo or self._router.slo).ttft_s,
            "tbt_s": (slo or self._router.slo).tbt_s,
        }
        return json_response(doc)

    def status_section(self) -> dict[str, Any]:
        """The "conductor" section of /admin/status: policy, SLOs, this node's
        cost model and how well it fits, and the decisions counted so far."""
        r = self._router
        adm = r.admission
        costs = self._services.costs
        ttft_margin, tbt_margin = adm.margins()
        out: dict[str, Any] = {
            "policy": adm.params.policy.value,
            "early_reject": adm.params.early_reject.value,
            # How entries deciding on one view keep apart (cluster/ranking.spread,
            # engine/late_binding), and who is served past the TTFT SLO.
            "spread": adm.params.spread,
            "decode_spread": adm.params.decode_spread,
            "late_binding": adm.params.late_binding,
            "bind_slack": adm.params.bind_slack,
            "max_prefill": adm.params.max_prefill,
            "best_effort_wait": adm.params.best_effort_wait,
            "slo": {"ttft_s": adm.slo.ttft_s, "tbt_s": adm.slo.tbt_s, "target": adm.target},
            "decisions": [
                {"policy": p, "outcome": o, "count": n}
                for (p, o), n in sorted(adm.decisions.items())
            ],
            "rejections": [
                {"policy": p, "reason": o, "count": n}
                for (p, o), n in sorted(adm.rejections.items())
            ],
            "pending_placements": len(adm.ledger),
            # Admitted though only the margins rejected them, nothing else
            # having been admitted for a while (admission.PROBE_AFTER_S).
            "probes": adm.num_probes,
            # Output tokens this entry expects of a request, from those it placed.
            "entry_expected_output_tokens": round(adm.lengths.mean(), 1),
            # This entry's correction of the models by what it measured.
            "calibration": {
                name: {
                    "offset_s": round(c.offset_s, 6),
                    "scale": round(c.scale, 4),
                    # What admission multiplies the corrected forecast by.
                    "margin": round(margin, 4),
                    "samples": len(c),
                }
                for name, c, margin in (
                    ("ttft", adm.ttft_calibration, ttft_margin),
                    ("tbt", adm.tbt_calibration, tbt_margin),
                )
            },
        }
        if costs is not None:
            model = costs.costs()
            out["costs"] = model.to_json()
            out["cost_samples"] = costs.fitter.num_samples
            err = costs.fitter.median_relative_error()
            out["cost_median_relative_error"] = None if err != err else round(err, 4)
            out["profiled"] = costs.profiled
            out["expected_output_tokens"] = round(costs.lengths.mean(), 1)
        return out


class ConductorCollector:
    """Decisions and rejections by policy, outcome and reason; the fitted costs."""

    def __init__(self, services: Services) -> None:
        self._services = services
        self._router = services.router

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        r = self._router.admission
        decisions = CounterMetricFamily(
            "mooncaked_conductor_decisions",
            "Placement decisions by policy and outcome (colocated, disaggregated, fetch, "
            "rejected).",
            labels=["policy", "outcome"],
        )
        for (policy, outcome), n in sorted(r.decisions.items()):
            decisions.add_metric([policy, outcome], n)
        yield decisions
        rejections = CounterMetricFamily(
            "mooncaked_conductor_rejections",
            "Requests rejected at admission, by policy and reason.",
            labels=["policy", "reason"],
        )
        for (policy, reason), n in sorted(r.rejections.items()):
            rejections.add_metric([policy, reason], n)
        yield rejections
        yield CounterMetricFamily(
            "mooncaked_conductor_probes",
            "Requests admitted although only the admission margins rejected them, after "
            "nothing had been admitted for a while (so the margins are measured again).",
            value=r.num_probes,
        )
        costs = self._services.costs
        if costs is not None:
            step = costs.fitter.cost
            coef = GaugeMetricFamily(
                "mooncaked_cost_model_coefficient",
                "This node's fitted step-time model (seconds per unit of each term).",
                labels=["term"],
            )
            for term, value in zip(
                ("base", "prefill_token", "prefill_pair", "decode_seq", "decode_ctx_token"),
                step.coefficients(),
                strict=True,
            ):
                coef.add_metric([term], value)
            yield coef
