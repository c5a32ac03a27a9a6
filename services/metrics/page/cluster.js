// The live cluster page: polls the collector's /cluster JSON every second and renders it.
// Every string from the network (worker ids, error codes, messages) enters the DOM through
// text nodes (`el` below), never as markup.
"use strict";

const POLL_MS = 1000;
const ROLE_TITLES = { prefill: "Prefill", decode: "Decode", both: "Prefill + decode" };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function replace(id, ...children) {
  document.getElementById(id).replaceChildren(...children.flat());
}

const number = (value, digits = 0) =>
  value === null || value === undefined ? "–" : Number(value).toFixed(digits);
const percent = (ratio) => (ratio === null || ratio === undefined ? "–" : `${(ratio * 100).toFixed(0)}%`);
const rate = (perSecond) => (perSecond ? perSecond.toFixed(1) : "0");
const ago = (now, at) => `${Math.max(0, now - at).toFixed(0)} s ago`;

function bytesPerSecond(value) {
  const units = ["B/s", "KB/s", "MB/s", "GB/s"];
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function bytes(value) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

// The shape's tooltip: what each KV rank's agent read and wrote since the worker started.
function rankTransfers(worker) {
  return (worker.kv_ranks || []).map((rank) =>
    `rank ${rank.rank}: read ${bytes(rank.reads.nbytes)}, wrote ${bytes(rank.writes.nbytes)}` +
    (rank.reads.failed + rank.writes.failed ? `, ${rank.reads.failed + rank.writes.failed} failed` : "")).join("\n");
}

function table(headers, rows, attrs) {
  return el("table", attrs,
    el("thead", {}, el("tr", {}, headers.map((header) => el("th", {}, header)))),
    el("tbody", {}, rows));
}

function emptyNote(text) {
  return el("p", { class: "empty" }, text);
}

function kvBar(worker) {
  const usage = Math.min(1, Math.max(0, worker.kv_usage || 0));
  const level = usage > 0.9 ? "high" : usage > 0.7 ? "mid" : "low";
  return el("div", { class: "kv" },
    el("div", { class: `bar ${level}`, role: "meter", "aria-valuenow": usage.toFixed(2) },
      el("span", { style: `width:${(usage * 100).toFixed(1)}%` })),
    el("span", { class: "kv-text" }, `${worker.kv_used_blocks}/${worker.kv_total_blocks} (${percent(usage)})`));
}

function renderTotals(status) {
  const totals = status.totals;
  const activity = status.activity;
  const cards = [
    ["workers", totals.workers],
    ["running", totals.running],
    ["waiting", totals.waiting],
    ["KV used", percent(totals.kv_usage)],
    ["requests/s", rate(activity.requests_per_s)],
    ["transfers/s", rate(activity.transfers_per_s)],
    ["transferred", bytesPerSecond(activity.transfer_bytes_per_s)],
    ["prefix hits", percent(totals.prefix_hit_rate)],
    ["recent errors", activity.recent_errors.length],
  ];
  replace("totals", cards.map(([label, value]) =>
    el("div", { class: "card" }, el("div", { class: "value" }, value), el("div", { class: "label" }, label))));
}

function workerRow(worker, activity) {
  const rates = activity.workers[worker.worker_id] || { requests_per_s: 0, transfers_in_per_s: 0, transfers_out_per_s: 0 };
  return el("tr", { "data-worker-id": worker.worker_id, "data-role": worker.role, "data-state": worker.status },
    el("td", { class: "id" }, worker.worker_id),
    el("td", {}, el("span", { class: `pill ${worker.status}` }, worker.status)),
    el("td", {}, worker.engine),
    el("td", { class: "shape", title: rankTransfers(worker) || null }, worker.shape || "–"),
    el("td", {}, kvBar(worker)),
    el("td", { class: "num" }, worker.running),
    el("td", { class: "num" }, worker.waiting),
    el("td", { class: "num" }, worker.active_leases),
    el("td", { class: "num" }, rate(rates.requests_per_s)),
    el("td", { class: "num" }, `${rate(rates.transfers_in_per_s)} / ${rate(rates.transfers_out_per_s)}`),
    el("td", { class: "num" }, percent(worker.prefix_hit_rate)),
    el("td", { class: "hash", title: worker.compat_hash }, (worker.compat_hash || "").slice(0, 10)),
    el("td", { class: worker.restarts ? "num restarted" : "num", title: worker.last_exit || "" },
      worker.restarts ? `${worker.restarts} (${worker.last_exit || "?"})` : "0"));
}

function renderRoles(status) {
  const byId = new Map(status.workers.map((worker) => [worker.worker_id, worker]));
  const groups = status.roles.map((group) => {
    const totals = group.totals;
    return el("div", { class: "role", "data-role": group.role },
      el("h3", {}, ROLE_TITLES[group.role] || group.role,
        el("small", {}, ` ${totals.workers} worker${totals.workers === 1 ? "" : "s"} · running ${totals.running}` +
          ` · waiting ${totals.waiting} · KV ${percent(totals.kv_usage)}`)),
      table(["worker", "status", "engine", "shape", "KV blocks", "running", "waiting", "leases", "req/s",
        "transfers in/out /s", "prefix hits", "compat", "restarts (last exit)"],
        group.worker_ids.map((id) => workerRow(byId.get(id), status.activity)), { class: "workers" }));
  });
  replace("roles", groups.length ? groups : emptyNote("No worker registered."));
}

function renderDeparted(status) {
  const departed = status.activity.departed;
  if (!departed.length) { replace("departed"); return; }
  replace("departed", el("h3", {}, "Gone"),
    table(["worker", "role", "left", "why"], departed.map((worker) =>
      el("tr", { "data-worker-id": worker.worker_id, "data-role": worker.role, "data-state": "gone", class: "gone" },
        el("td", { class: "id" }, worker.worker_id),
        el("td", {}, worker.role),
        el("td", {}, ago(status.now, worker.left_at)),
        el("td", {}, el("span", { class: `pill ${worker.reason}` }, worker.reason)))), { class: "departed" }));
}

function renderRouting(status) {
  const activity = status.activity;
  document.getElementById("window").textContent = `last ${number(activity.window_s)} s`;
  const counts = Object.entries(activity.requests_by_worker);
  const most = Math.max(1, ...counts.map(([, count]) => count));
  const bars = counts.length ? el("div", { class: "decisions" }, counts.map(([workerId, count]) =>
    el("div", { class: "decision" },
      el("span", { class: "id" }, workerId),
      el("div", { class: "bar low" }, el("span", { style: `width:${((count / most) * 100).toFixed(1)}%` })),
      el("span", { class: "num" }, count)))) : emptyNote("No request in the window.");
  const outcomes = Object.entries(activity.requests_by_outcome).map(([outcome, count]) =>
    el("span", { class: `pill ${outcome === "ok" ? "ok" : "error"}` }, `${outcome} ${count}`));
  const recent = activity.recent_requests.length ? table(
    ["when", "request", "worker", "outcome", "prompt", "cached", "out", "TTFT"],
    activity.recent_requests.map((request) => el("tr", {},
      el("td", {}, ago(status.now, request.at)),
      el("td", { class: "id", title: request.request_id }, request.request_id),
      el("td", { class: "id", title: request.worker_id }, request.worker_id || "–"),
      el("td", {}, el("span", { class: `pill ${request.outcome === "ok" ? "ok" : "error"}` }, request.outcome)),
      el("td", { class: "num" }, request.prompt_tokens),
      el("td", { class: "num" }, request.cached_tokens),
      el("td", { class: "num" }, request.completion_tokens),
      el("td", { class: "num" }, request.ttft_s === null ? "–" : `${(request.ttft_s * 1000).toFixed(0)} ms`))),
    { class: "requests" }) : null;
  replace("routing", bars, el("div", { class: "outcomes" }, outcomes), recent);
}

function renderErrors(status) {
  const errors = status.activity.recent_errors;
  replace("errors", errors.length ? table(["when", "kind", "code", "worker", "request", "detail"],
    errors.map((error) => el("tr", { "data-kind": error.kind },
      el("td", {}, ago(status.now, error.at)),
      el("td", {}, error.kind),
      el("td", {}, el("span", { class: "pill error" }, error.code)),
      el("td", { class: "id", title: error.worker_id }, error.worker_id || "–"),
      el("td", { class: "id", title: error.request_id }, error.request_id || "–"),
      el("td", { class: "detail" }, error.peer_worker_id ? `peer ${error.peer_worker_id}${error.message ? ": " : ""}${error.message}`
        : error.message))), { class: "errors" }) : emptyNote("No error lately."));
}

function render(status) {
  renderTotals(status);
  renderRoles(status);
  renderDeparted(status);
  renderRouting(status);
  renderErrors(status);
}

function setConnection(state, text) {
  const connection = document.getElementById("connection");
  connection.dataset.state = state;
  connection.textContent = text;
}

async function poll() {
  try {
    const response = await fetch("/cluster", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const status = await response.json();
    render(status);
    setConnection("live", `live · ${new Date(status.now * 1000).toLocaleTimeString()}`);
  } catch (error) {
    setConnection("down", `collector unreachable (${error.message}); retrying`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
