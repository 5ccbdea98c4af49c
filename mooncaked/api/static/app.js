// The mooncaked status page: polls this node's admin API and renders it.
//
// Every value lands in an element with a stable id or data-* attribute, and
// raw numbers ride along in data-value, so tools (and the tests) can read the
// page as well as people can. Text is set through textContent only: node ids
// and addresses come from gossip and are never parsed as markup.
"use strict";

const POLL_MS = 2000;
const RECENT_LIMIT = 50;

// Byte counters of the previous poll, to turn totals into rates; keyed by
// node incarnation so a restarted node does not yield a negative rate.
let previous = null;
let numRefreshes = 0;

async function getJSON(path) {
  const resp = await fetch(path, { cache: "no-store" });
  if (!resp.ok) {
    let detail = "";
    try {
      const body = await resp.json();
      detail = body && body.error && body.error.message ? `: ${body.error.message}` : "";
    } catch (_) {
      // Not JSON: the status code says enough.
    }
    throw new Error(`${path} answered ${resp.status}${detail}`);
  }
  return resp.json();
}

// ------------------------------------------------------------------ formats

function fmtPercent(ratio) {
  if (ratio === null || ratio === undefined || Number.isNaN(ratio)) return "–";
  return `${(ratio * 100).toFixed(1)}%`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(1)} ms`;
  if (s < 60) return `${s.toFixed(2)} s`;
  return fmtUptime(s);
}

function fmtUptime(s) {
  const total = Math.floor(s);
  const d = Math.floor(total / 86400);
  const h = Math.floor((total % 86400) / 3600);
  const m = Math.floor((total % 3600) / 60);
  const sec = total % 60;
  const pad = (n) => String(n).padStart(2, "0");
  if (d) return `${d}d ${pad(h)}h ${pad(m)}m`;
  if (h) return `${h}h ${pad(m)}m ${pad(sec)}s`;
  if (m) return `${m}m ${pad(sec)}s`;
  return `${sec}s`;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function fmtRate(bytesPerS) {
  return bytesPerS === null ? "–" : `${fmtBytes(bytesPerS)}/s`;
}

function fmtTime(unixS) {
  return new Date(unixS * 1000).toLocaleTimeString([], { hour12: false });
}

// --------------------------------------------------------------------- DOM

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  }
  return e;
}

// A table cell with its raw value in data-value and its field name in data-field.
function cell(field, text, value, cls) {
  return el("td", text, { "data-field": field, "data-value": value, class: cls });
}

function meter(ratio) {
  const m = el("meter", null, { min: 0, max: 1, low: 0.7, high: 0.9, optimum: 0 });
  m.value = ratio || 0;
  m.textContent = fmtPercent(ratio);
  return m;
}

function setText(id, text, value) {
  const e = document.getElementById(id);
  e.textContent = text;
  if (value !== undefined) e.dataset.value = String(value);
}

function replaceRows(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
}

// ----------------------------------------------------------------- renders

function renderNode(status) {
  setText("node-id", status.node_id);
  setText("node-model", status.model === null ? "loading" : status.model);
  setText("node-role", status.role);
  const state = status.draining ? "draining" : status.ready ? "ready" : "starting";
  setText("node-state", state);
  document.getElementById("node-state").className = `state-${state}`;
  setText("node-uptime", fmtUptime(status.uptime_s), status.uptime_s);
  setText("node-version", status.version);
  document.title = `mooncaked · ${status.node_id}`;

  const load = status.load;
  setText("sum-load", `${load.running} · ${load.waiting}`, load.running + load.waiting);
  setText("sum-kv", status.kv ? fmtPercent(status.kv.usage) : "–", status.kv ? status.kv.usage : "");
  const hit = status.prefix_cache;
  setText("sum-hit", hit ? fmtPercent(hit.hit_rate) : "–", hit ? hit.hit_rate : "");
}

function memberState(node) {
  const st = node.state;
  if (node.status === "alive" && st && st.draining) return "draining";
  return node.status;
}

function renderMembers(cluster) {
  const rows = cluster.nodes.map((node) => {
    const st = node.state;
    const load = st ? st.load : null;
    const state = memberState(node);
    const tr = el("tr", null, {
      "data-node-id": node.node_id,
      "data-role": st ? st.role : "",
      "data-status": node.status,
      "data-self": node.self ? "true" : "false",
    });
    const name = cell("node_id", node.node_id, node.node_id);
    if (node.self) name.append(el("span", "this node", { class: "tag" }));
    const kv = cell("kv_usage", null, load ? load.kv_usage : "");
    if (load) kv.append(meter(load.kv_usage), el("span", ` ${fmtPercent(load.kv_usage)}`));
    else kv.textContent = "–";
    tr.append(
      name,
      cell("role", st ? st.role : "–", st ? st.role : ""),
      cell("state", state, state, `state-${state}`),
      cell("queued_prefill_tokens", load ? load.queued_prefill_tokens : "–", load ? load.queued_prefill_tokens : "", "num"),
      cell("running_decode_batch", load ? load.running_decode_batch : "–", load ? load.running_decode_batch : "", "num"),
      cell("predicted_queue_s", load ? fmtSeconds(load.predicted_queue_s) : "–", load ? load.predicted_queue_s : "", "num"),
      kv,
      cell("cached_blocks", node.cached_blocks, node.cached_blocks, "num"),
      cell("api_addr", st ? st.api_addr : "–", st ? st.api_addr : ""),
      cell("last_heard_s", node.self ? "–" : fmtSeconds(node.last_heard_s), node.last_heard_s, "num"),
    );
    return tr;
  });
  replaceRows("members", rows);
  const s = cluster.summary;
  const alive = s.by_status.alive || 0;
  setText("members-count", `${alive} alive of ${s.members}`, s.members);
  setText("sum-members", `${alive} / ${s.members}`, alive);
  const roles = Object.entries(s.by_role)
    .map(([role, n]) => `${n} ${role}`)
    .join(", ");
  const c = cluster.counters;
  setText(
    "gossip",
    `roles: ${roles || "none"} · cached blocks in the cluster index: ${s.cached_blocks} · ` +
      `gossip packets sent ${c.packets_sent}, received ${c.packets_received}, ` +
      `suspicions ${c.suspicions_raised}, syncs ok ${c.syncs_ok} / failed ${c.syncs_failed}`,
  );
}

function tierRow(tier, label, hitRate, used, total) {
  const ratio = total ? used / total : 0;
  const tr = el("tr", null, { "data-tier": tier });
  const bar = el("td", null, { "data-field": "usage", "data-value": ratio });
  bar.append(meter(ratio));
  tr.append(
    cell("tier", label, tier),
    cell("hit_rate", fmtPercent(hitRate), hitRate, "num"),
    bar,
    cell("blocks", `${used} / ${total}`, used, "num"),
  );
  return tr;
}

function renderTiers(status) {
  const rows = [];
  if (status.kv) {
    // The device tier's hit rate counts prompt tokens served from the prefix cache.
    const hit = status.prefix_cache ? status.prefix_cache.hit_rate : null;
    rows.push(tierRow("device", "device (GPU/CPU KV)", hit, status.kv.blocks_used, status.kv.blocks_total));
  }
  const store = status.store;
  if (store) {
    const d = store.dram;
    rows.push(tierRow("dram", "DRAM", d.hit_ratio, d.blocks_used, d.blocks_total));
    if (store.ssd) {
      const s = store.ssd;
      rows.push(tierRow("ssd", "SSD", s.hit_ratio, s.blocks_used, s.blocks_total));
    }
  }
  replaceRows("tiers", rows);
}

// Byte counters of /admin/cache/stats: [key, label, read from the stats].
const FLOWS = [
  ["read", "read from peers (this node's transfer ops)", (s) => s.transfer && s.transfer.bytes_read],
  ["written", "written to peers (this node's transfer ops)", (s) => s.transfer && s.transfer.bytes_written],
  ["served_read", "read by peers from this node", (s) => s.transfer && s.transfer.served_bytes_read],
  ["served_written", "written by peers into this node", (s) => s.transfer && s.transfer.served_bytes_written],
  ["peer_fetch", "prefix blocks fetched from peers", (s) => s.peer && s.peer.bytes],
  ["dram_read", "loaded out of DRAM", (s) => s.dram && s.dram.bytes_read],
  ["ssd_read", "loaded out of SSD", (s) => s.ssd && s.ssd.bytes_read],
];

function renderTransfer(status, stats) {
  const now = { t: status.uptime_s, key: status.cluster ? status.cluster.incarnation : status.node_id, bytes: {} };
  for (const [key, , read] of FLOWS) now.bytes[key] = read(stats) ?? null;
  const prev = previous && previous.key === now.key && now.t > previous.t ? previous : null;
  const rates = {};
  const rows = FLOWS.filter(([key]) => now.bytes[key] !== null).map(([key, label]) => {
    const total = now.bytes[key];
    let rate = null;
    if (prev && prev.bytes[key] !== null && total >= prev.bytes[key]) {
      rate = (total - prev.bytes[key]) / (now.t - prev.t);
    }
    rates[key] = rate;
    const tr = el("tr", null, { "data-flow": key });
    tr.append(
      cell("flow", label, key),
      cell("rate", fmtRate(rate), rate === null ? "" : rate, "num"),
      cell("total", fmtBytes(total), total, "num"),
    );
    return tr;
  });
  replaceRows("transfer", rows);
  previous = now;
  const inRate = rates.read === undefined ? null : rates.read;
  const outRate = rates.served_read === undefined ? null : rates.served_read;
  setText("sum-transfer", inRate === null || outRate === null ? "–" : `${fmtRate(inRate)} · ${fmtRate(outRate)}`);
  const peer = stats.peer;
  const t = stats.transfer;
  setText(
    "transfer-note",
    `${t ? `endpoint ${t.address} · ops done ${t.ops_done}, failed ${t.ops_failed} · ` : ""}` +
      `peer fetches ok ${peer.ok}, failed ${peer.failed}, missed ${peer.missed} · ` +
      `leases held by peers ${stats.leases.active}`,
  );
}

// Ids are long (a prefix and 32 hex digits): the start tells them apart, the tooltip has it all.
function shortId(id) {
  const td = cell("request_id", id.length > 22 ? `${id.slice(0, 21)}…` : id, id, "id");
  td.title = id;
  return td;
}

function renderRequests(recent) {
  const rows = recent.requests.map((r) => {
    const decodeS = r.ttft_s === null ? null : Math.max(0, r.e2e_s - r.ttft_s);
    // Time between tokens: the decode phase spread over the tokens after the first.
    const tbt = decodeS !== null && r.output_tokens > 1 ? decodeS / (r.output_tokens - 1) : null;
    const tr = el("tr", null, {
      "data-request-id": r.request_id,
      "data-prefill-node": r.prefill_node,
      "data-decode-node": r.decode_node,
      "data-finish-reason": r.finish_reason,
    });
    tr.append(
      cell("finished_at", fmtTime(r.finished_at), r.finished_at),
      shortId(r.request_id),
      cell("endpoint", r.endpoint, r.endpoint),
      cell("prompt_tokens", r.prompt_tokens, r.prompt_tokens, "num"),
      cell("cached_tokens", r.cached_tokens, r.cached_tokens, "num"),
      cell("output_tokens", r.output_tokens, r.output_tokens, "num"),
      cell("prefill_node", r.prefill_node, r.prefill_node),
      cell("ttft_s", fmtSeconds(r.ttft_s), r.ttft_s === null ? "" : r.ttft_s, "num"),
      cell("decode_node", r.decode_node, r.decode_node),
      cell("decode_s", fmtSeconds(decodeS), decodeS === null ? "" : decodeS, "num"),
      cell("tbt_s", fmtSeconds(tbt), tbt === null ? "" : tbt, "num"),
      cell("e2e_s", fmtSeconds(r.e2e_s), r.e2e_s, "num"),
      cell("finish_reason", r.finish_reason, r.finish_reason, `finish-${r.finish_reason}`),
    );
    return tr;
  });
  if (!rows.length) {
    rows.push(el("tr", null, { class: "empty" }));
    rows[0].append(el("td", "no request has finished on this node yet", { colspan: 13 }));
  }
  replaceRows("requests", rows);
  const dropped = recent.num_dropped ? ` (older ones dropped: ${recent.num_dropped})` : "";
  setText(
    "requests-count",
    `newest ${recent.requests.length} of ${recent.num_recorded} served here${dropped}`,
    recent.requests.length,
  );
}

// -------------------------------------------------------------------- loop

async function refresh() {
  const [status, cluster, stats, recent] = await Promise.allSettled([
    getJSON("/admin/status"),
    getJSON("/admin/cluster"),
    getJSON("/admin/cache/stats"),
    getJSON(`/admin/requests/recent?limit=${RECENT_LIMIT}`),
  ]);
  const errors = [];
  // One failing part (a subsystem still starting) leaves the others rendered.
  const attempt = (name, fn) => {
    try {
      fn();
    } catch (err) {
      errors.push(`${name}: ${err.message}`);
    }
  };
  for (const r of [status, cluster, stats, recent]) {
    if (r.status === "rejected") errors.push(r.reason.message);
  }
  if (status.status === "fulfilled") {
    attempt("node", () => renderNode(status.value));
    attempt("tiers", () => renderTiers(status.value));
    if (stats.status === "fulfilled") attempt("transfers", () => renderTransfer(status.value, stats.value));
  }
  if (cluster.status === "fulfilled") attempt("members", () => renderMembers(cluster.value));
  if (recent.status === "fulfilled") attempt("requests", () => renderRequests(recent.value));

  const banner = document.getElementById("error");
  banner.textContent = errors.join(" · ");
  banner.hidden = errors.length === 0;
  numRefreshes += 1;
  document.body.dataset.refreshes = String(numRefreshes);
  document.body.dataset.state = errors.length ? "error" : "ok";
  setText("updated-at", new Date().toLocaleTimeString([], { hour12: false }));
}

async function loop() {
  try {
    await refresh();
  } catch (err) {
    document.body.dataset.state = "error";
    const banner = document.getElementById("error");
    banner.textContent = `refresh failed: ${err.message}`;
    banner.hidden = false;
  }
  // The next poll is timed from the end of this one, so slow answers never pile up.
  setTimeout(loop, POLL_MS);
}

loop();
