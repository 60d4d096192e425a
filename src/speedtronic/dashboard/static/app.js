// speedtronic dashboard: polls /api/state and draws each source (runs folders, DiLoCo swarms) with
// hand-written inline SVG. Everything from the server is data: it is put in the page as text nodes and
// attributes only, never as HTML, so a hostile node name or rejection reason cannot inject markup.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#0a7ea4", "#bf3989", "#57606a",
  "#e16f24", "#116329"];
const CLOSED = { all: "#1a7f37", grace: "#1f6feb", max_wait: "#e16f24", not_live: "#8250df" };
const view = { x: {} }; // per source: "step" or "time" (the loss chart's x axis)
let last = null; // the latest state, with the client time it arrived at
let failingSince = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
    else node.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// ------------------------------------------------------------------------------------------ numbers
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
function fmt(v, digits = 4) {
  if (!isNum(v)) return "–";
  if (Number.isInteger(v) && Math.abs(v) < 1e15) return v.toLocaleString("en-US");
  return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en-US") : v.toFixed(digits);
}
function bytes(v) {
  if (!isNum(v)) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}
function ago(seconds) {
  if (!isNum(seconds)) return "never";
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}
function clock(unix) {
  if (!isNum(unix)) return "–";
  return new Date(unix * 1000).toLocaleTimeString("en-GB", { hour12: false });
}
function duration(s) {
  if (!isNum(s)) return "–";
  if (s < 120) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  const m = Math.floor(s / 60);
  return m < 120 ? `${m} min ${Math.round(s % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}
function niceTicks(lo, hi, n) {
  const span = hi - lo || 1;
  const raw = span / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => span / s <= n) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

// ------------------------------------------------------------------------------------------- charts
// series: [{name, color, points: [[x, y, label?]], kind: "line" | "bars", colors?: [...]}]
function chart(name, series, opts = {}) {
  const W = 460, H = 230, L = 50, R = 10, T = 8, B = 32;
  const all = series.flatMap((s) => s.points.filter((p) => isNum(p[0]) && isNum(p[1])));
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-chart": name,
    "aria-label": opts.title || name });
  if (!all.length) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, opts.empty || "no data yet"));
    return root;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (opts.zero) y0 = Math.min(0, y0);
  const bars = series.some((s) => s.kind === "bars");
  if (bars) { x0 -= 0.5; x1 += 0.5; }
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const pad = (y1 - y0) * 0.06 || Math.abs(y1) * 0.05 || 1;
  y1 += pad; if (!opts.zero || y0 < 0) y0 -= pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const t of niceTicks(y0, y1, 5)) {
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
    root.append(svg("text", { x: L - 6, y: sy(t) + 4, "text-anchor": "end" }, fmtTick(t)));
  }
  const xticks = opts.time ? niceTicks(x0, x1, 5) : niceTicks(x0, x1, 6).filter((t) => Number.isInteger(t));
  let shown = null;
  for (const t of xticks) {
    const label = opts.time ? clock(t) : fmtTick(t);
    if (label === shown) continue; // a span of seconds: one label per second
    shown = label;
    root.append(svg("line", { class: "axis", x1: sx(t), x2: sx(t), y1: H - B, y2: H - B + 4 }));
    const anchor = sx(t) > W - R - 24 ? "end" : "middle"; // the last label stays inside the chart
    root.append(svg("text", { x: anchor === "end" ? W - R : sx(t), y: H - B + 16, "text-anchor": anchor }, label));
  }
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle" }, opts.xTitle || ""));
  root.append(svg("text", { x: 12, y: T + (H - T - B) / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${T + (H - T - B) / 2})` }, opts.yTitle || ""));
  series.forEach((s) => drawSeries(root, s, sx, sy, bars ? (W - L - R) / (x1 - x0) : 0, y0));
  return root;
}

function fmtTick(t) {
  if (Math.abs(t) >= 1e6) return `${(t / 1e6).toPrecision(3)}M`;
  if (Math.abs(t) >= 1e4) return `${(t / 1e3).toPrecision(3)}k`;
  return String(Number(t.toPrecision(4)));
}

function drawSeries(root, s, sx, sy, barWidth, y0) {
  const points = s.points.filter((p) => isNum(p[0]) && isNum(p[1])).sort((a, b) => a[0] - b[0]);
  if (!points.length) return;
  const lastX = points[points.length - 1][0];
  const group = svg("g", { "data-series": s.name, "data-last-x": lastX, "data-points": points.length });
  if (s.kind === "bars") {
    points.forEach((p, i) => {
      const w = Math.max(2, barWidth * 0.7);
      group.append(svg("rect", { x: sx(p[0]) - w / 2, y: Math.min(sy(p[1]), sy(Math.max(0, y0))), width: w,
        height: Math.abs(sy(Math.max(0, y0)) - sy(p[1])), fill: (s.colors && s.colors[i]) || s.color },
        svg("title", {}, p[2] || `${p[0]}: ${p[1]}`)));
    });
  } else {
    group.append(svg("polyline", { points: points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "),
      fill: "none", stroke: s.color, "stroke-width": s.width || 2, "stroke-linejoin": "round",
      "stroke-dasharray": s.dash || null }));
    if (points.length <= 120) {
      for (const p of points) {
        group.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: s.width > 2 ? 3.2 : 2.4, fill: s.color },
          svg("title", {}, p[2] || `${s.name}: ${fmt(p[1])} at ${p[0]}`)));
      }
    }
  }
  root.append(group);
}

function legend(series) {
  return el("div", { class: "legend" }, series.filter((s) => s.points.length).map((s) =>
    el("span", {}, svg("svg", { width: 14, height: 10 }, svg("rect", { width: 14, height: 10, rx: 2, fill: s.color })), s.name)));
}

function figure(title, chartNode, series, extra) {
  return el("figure", {}, el("figcaption", {}, el("span", {}, title), extra || null), chartNode,
    series ? legend(series) : null);
}

// ------------------------------------------------------------------------------------------- swarm
function nodeState(c) {
  if (c.quarantined) return "quarantined";
  if (c.finished) return "finished";
  if (c.consecutive_rejections > 0) return "rejecting";
  if (!isNum(c.last_seen_s_ago)) return "waiting";
  return c.last_seen_s_ago > 600 ? "quiet" : "active";
}

function checksByNode(status) {
  const out = {};
  for (const r of status.rejected_recent || []) {
    const node = String(r.id || "").split("/")[0];
    (out[node] = out[node] || new Set()).add(String(r.check || "?"));
  }
  return out;
}

function evalText(e) {
  if (!e) return "–";
  const parts = [`step ${e.step}`];
  if (isNum(e.val_loss)) parts.push(`val ${e.val_loss.toFixed(4)}`);
  if (isNum(e.core)) parts.push(`CORE ${e.core.toFixed(3)}`);
  for (const [k, v] of Object.entries(e.tasks || {})) if (isNum(v)) parts.push(`${k} ${v.toFixed(3)}`);
  return parts.join(" · ");
}

function published(stamp) {
  const at = Date.parse(stamp || "");
  return Number.isNaN(at) ? "never" : ago(Math.max(0, serverNow() - at / 1000));
}

function tile(k, v, s, key) {
  return el("div", { class: "tile", "data-tile": key || null }, el("div", { class: "k" }, k), el("div", { class: "v" }, v),
    s ? el("div", { class: "s" }, s) : null);
}

function swarmTiles(src, status) {
  const lease = status.lease || {};
  const leaseLeft = lease.expires_at ? (Date.parse(lease.expires_at) / 1000 - serverNow()) : null;
  const standby = status.standby === undefined ? "not announced on the bus" :
    (status.standby ? `waiting: ${status.standby.holder || status.standby}` : "none");
  const nodes = status.collaborators || [];
  const up = Object.values(status.nodes || {}).reduce((a, n) => a + (isNum(n.bytes) ? n.bytes : 0), 0);
  const down = isNum(src.global_bytes) ? src.global_bytes * nodes.reduce((a, c) => a + (c.applied || 0), 0) : null;
  const round = status.round || {};
  return el("div", { class: "tiles" },
    tile("outer step", `${status.outer_step}${status.end ? ` / ${status.end}` : ""}`,
      status.end_reason ? `ended: ${status.end_reason}` : `published ${published(status.updated_at)}`, "outer_step"),
    tile("deltas", `${status.applied} applied`, `${status.rejected} rejected · ${status.pending} pending · ${status.new_on_bus} new on the bus`, "deltas"),
    tile("nodes", `${nodes.length}`, `${(status.finished || []).length} finished · ${nodes.filter((c) => c.quarantined).length} quarantined`, "nodes"),
    tile("global model", status.global_eval && isNum(status.global_eval.val_loss) ? status.global_eval.val_loss.toFixed(4) : "–",
      status.global_eval ? evalText(status.global_eval) : "no evaluation yet", "global"),
    tile("master lease", lease.holder || "–", lease.holder ? `epoch ${status.epoch ?? "–"} · ${isNum(leaseLeft) ?
      (leaseLeft >= 0 ? `renews within ${Math.round(leaseLeft)} s` : `lapsed ${Math.round(-leaseLeft)} s ago`) : ""} · standby: ${standby}` : "no lease published", "lease"),
    tile("round now", round.rule || "–", round.outer_step !== undefined ? `step ${round.outer_step} · waiting on ${(round.waiting_on || []).join(", ") || "nobody"}` : "", "round"),
    tile("bytes", `${bytes(up)} up`, down !== null ? `≈ ${bytes(down)} down (one ${bytes(src.global_bytes)} global per delta)` : "down: unknown", "bytes"));
}

function lossChart(src, status) {
  const h = src.history || {};
  const mode = view.x[src.id] || "step";
  const time = mode === "time";
  const pick = (outer, at) => (time ? at : outer);
  const series = [{ name: "global", color: "#111827", width: 3,
    points: (h.global_loss || []).map(([s, v, t]) => [pick(s, t), v, `global · outer step ${s}: ${v.toFixed(4)}`]) }];
  Object.entries(h.node_loss || {}).forEach(([node, pts], i) => series.push({ name: node, color: COLORS[i % COLORS.length], dash: "5 3",
    points: pts.map(([outer, v, t, step]) => [pick(outer, t), v, `${node} · local step ${step} (outer step ${outer}): ${v.toFixed(4)}`]) }));
  const toggle = el("span", { class: "toggle" }, ["step", "time"].map((m) => el("button", { type: "button",
    class: m === mode ? "on" : null, on: { click: () => { view.x[src.id] = m; if (last) render(last.state); } } },
  m === "step" ? "outer step" : "wall clock")));
  return figure("Validation loss: global model and each node's own", chart("loss", series,
    { xTitle: time ? "wall clock" : "outer step", yTitle: "val loss", time, empty: "no evaluation yet" }), series, toggle);
}

function tokensChart(src) {
  const rates = (src.history || {}).tokens_per_s || {};
  const series = Object.entries(rates).map(([node, pts], i) => ({ name: node, color: COLORS[i % COLORS.length], points: pts }));
  return figure("Tokens/s per node (counted)", chart("tokens", series, { xTitle: "wall clock", yTitle: "tokens/s", time: true,
    zero: true, empty: "needs two applied deltas of a node" }), series);
}

function roundsChart(src) {
  const rounds = ((src.history || {}).rounds || []).filter((r) => isNum(r.duration_s));
  const series = [{ name: "round", kind: "bars", color: "#57606a",
    colors: rounds.map((r) => CLOSED[r.closed_by] || "#57606a"),
    points: rounds.map((r) => [r.outer_step, r.duration_s, `outer step ${r.outer_step}: ${duration(r.duration_s)}, closed by ${r.closed_by || "?"}` +
      (r.without && r.without.length ? ` without ${r.without.join(", ")}` : "")]) }];
  const keys = Object.entries(CLOSED).map(([k, c]) => ({ name: `closed by ${k}`, color: c, points: [1] }));
  return figure("Round durations (colour: what closed the round)", chart("rounds", series,
    { xTitle: "outer step", yTitle: "seconds", zero: true, empty: "needs two consecutive outer steps" }), keys);
}

function nodeTable(src, status) {
  const checks = checksByNode(status);
  const cols = [["node", ""], ["state", ""], ["last seen", ""], ["lag", "num"], ["tokens counted", "num"],
    ["claimed", "num"], ["applied", "num"], ["rejected", "num"], ["rejected by", ""], ["quarantine", ""],
    ["agreement", "num"], ["own eval", ""], ["up", "num"], ["≈ down", "num"], ["pending", "num"]];
  const rows = (status.collaborators || []).map((c) => {
    const n = (status.nodes || {})[c.node] || {};
    const score = c.score || {};
    const cell = (key, value, text, cls) => el("td", { "data-key": key,
      "data-value": value === null || value === undefined ? "" : JSON.stringify(value), class: cls || null }, text);
    const by = [...(checks[c.node] || [])];
    const lastNo = Array.isArray(c.last_rejection) ? c.last_rejection : null;
    const claimed = isNum(c.tokens_claimed) ? c.tokens_claimed : n.tokens_claimed;
    return el("tr", { "data-node": c.node },
      cell("node", c.node, c.node),
      cell("state", nodeState(c), el("span", { class: `state ${nodeState(c)}` }, nodeState(c))),
      cell("last_seen_s_ago", c.last_seen_s_ago, ago(c.last_seen_s_ago)),
      cell("lag", c.lag, c.lag === null ? "–" : fmt(c.lag), "num"),
      cell("tokens", c.tokens, fmt(c.tokens), "num"),
      cell("tokens_claimed", claimed, fmt(claimed), "num"),
      cell("applied", c.applied, fmt(c.applied), "num"),
      cell("rejected", c.rejected, fmt(c.rejected), "num"),
      cell("rejected_by", by, by.length ? el("span", { class: "check", title: lastNo ? `${lastNo[0]}: ${lastNo[1]}` : "" }, by.join(", ")) :
        (lastNo ? String(lastNo[1]).slice(0, 60) : "–"), "wrap"),
      cell("quarantined", c.quarantined, c.quarantined ? "quarantined" : "no"),
      cell("agreement", score.agreement, isNum(score.agreement) ? score.agreement.toFixed(2) : "–", "num"),
      cell("eval", c.eval, evalText(c.eval), "wrap"),
      cell("bytes", n.bytes, bytes(n.bytes), "num"),
      cell("down", null, isNum(src.global_bytes) ? bytes(src.global_bytes * (c.applied || 0)) : "–", "num"),
      cell("pending_count", c.pending_count, fmt(c.pending_count), "num"));
  });
  return el("div", { class: "scroll" }, el("table", { "data-table": "nodes" },
    el("thead", {}, el("tr", {}, cols.map(([c, cls]) => el("th", { class: cls || null }, c)))), el("tbody", {}, rows)));
}

function evalTable(status) {
  const rows = [["global model", status.global_eval], ...(status.collaborators || []).map((c) => [c.node, c.eval])];
  const tasks = [...new Set(rows.flatMap(([, e]) => Object.keys((e && e.tasks) || {})))];
  return el("div", { class: "scroll" }, el("table", { "data-table": "evals" },
    el("thead", {}, el("tr", {}, el("th", {}, "model"), el("th", { class: "num" }, "step"), el("th", { class: "num" }, "val loss"),
      el("th", { class: "num" }, "CORE"), tasks.map((t) => el("th", { class: "num" }, t)))),
    el("tbody", {}, rows.map(([name, e]) => el("tr", {}, el("td", {}, name), el("td", { class: "num" }, e ? e.step : "–"),
      el("td", { class: "num" }, e ? fmt(e.val_loss) : "–"), el("td", { class: "num" }, e ? fmt(e.core, 3) : "–"),
      tasks.map((t) => el("td", { class: "num" }, e && e.tasks ? fmt(e.tasks[t], 3) : "–")))))));
}

function rejectedTable(status) {
  const recent = (status.rejected_recent || []).slice().reverse();
  if (!recent.length) return el("p", { class: "muted" }, "no delta rejected");
  return el("div", { class: "scroll" }, el("table", { "data-table": "rejected" },
    el("thead", {}, el("tr", {}, el("th", {}, "delta"), el("th", {}, "check"), el("th", {}, "reason"))),
    el("tbody", {}, recent.map((r) => el("tr", {}, el("td", {}, String(r.id || "?")), el("td", { class: "check" }, String(r.check || "?")),
      el("td", { class: "wrap" }, String(r.reason || "")))))));
}

function roundsTable(src) {
  const rounds = ((src.history || {}).rounds || []).slice(-8).reverse();
  if (!rounds.length) return el("p", { class: "muted" }, "no outer step seen yet");
  return el("div", { class: "scroll" }, el("table", { "data-table": "rounds" },
    el("thead", {}, el("tr", {}, ["outer step", "published", "took", "closed by", "waited after its first delta", "went without"].map((c) => el("th", {}, c)))),
    el("tbody", {}, rounds.map((r) => el("tr", {}, el("td", {}, r.outer_step), el("td", {}, clock(r.at)), el("td", {}, duration(r.duration_s)),
      el("td", {}, r.closed_by || "–"), el("td", {}, duration(r.waited_s)), el("td", { class: "wrap" }, (r.without || []).join(", ") || "nobody"))))));
}

function renderSwarm(src) {
  const status = src.status;
  if (!status) return [el("p", { class: "muted" }, src.error ? "no status read yet" : "reading the bus…")];
  return [swarmTiles(src, status),
    el("div", { class: "charts" }, lossChart(src, status), tokensChart(src), roundsChart(src)),
    el("h3", {}, "Nodes"), nodeTable(src, status),
    el("h3", {}, "Latest evaluation: the global model next to the nodes' own"), evalTable(status),
    el("h3", {}, "Rejected deltas (latest) and the check that refused each"), rejectedTable(status),
    el("h3", {}, "Rounds"), roundsTable(src)];
}

// -------------------------------------------------------------------------------------------- runs
function renderRuns(src) {
  const runs = src.runs || [];
  if (!runs.length) return [el("p", { class: "muted" }, "no runs here yet (a run writes <name>/metrics.jsonl)")];
  const color = (i) => COLORS[i % COLORS.length];
  const cols = ["run", "steps", "tokens", "loss", "val loss", "best val", "CORE", "tok/s", "wall", "optimizer", "lr", ""];
  const table = el("div", { class: "scroll" }, el("table", { "data-table": "runs" },
    el("thead", {}, el("tr", {}, cols.map((c, i) => el("th", { class: i > 0 && i < 9 ? "num" : null }, c)))),
    el("tbody", {}, runs.map((r, i) => el("tr", { "data-run": r.name },
      el("td", {}, svg("svg", { width: 10, height: 10, class: "dot" }, svg("rect", { width: 10, height: 10, rx: 2, fill: color(i) })), " ", r.name),
      el("td", { class: "num" }, fmt(r.steps)), el("td", { class: "num" }, fmt(r.tokens)), el("td", { class: "num" }, fmt(r.final_loss)),
      el("td", { class: "num" }, fmt(r.final_val_loss)), el("td", { class: "num" }, fmt(r.best_val_loss)), el("td", { class: "num" }, fmt(r.core, 3)),
      el("td", { class: "num" }, isNum(r.tokens_per_s) ? Math.round(r.tokens_per_s).toLocaleString("en-US") : "–"),
      el("td", { class: "num" }, duration(r.wall_s)), el("td", {}, r.optimizer || "–"), el("td", {}, isNum(r.lr) ? r.lr.toExponential(1) : "–"),
      el("td", {}, r.finished ? "finished" : "running or stopped"))))));
  const curves = (key) => runs.map((r, i) => ({ name: r.name, color: color(i), points: r[key] || [] }));
  const figures = [figure("Training loss", chart("train", curves("train"), { xTitle: "step", yTitle: "loss" }), curves("train")),
    figure("Validation loss", chart("val", curves("val"), { xTitle: "step", yTitle: "val loss", empty: "no evaluation yet" }), curves("val"))];
  const metrics = [...new Set(runs.flatMap((r) => Object.keys(r.evals || {})))].sort((a, b) => (a === "core" ? -1 : b === "core" ? 1 : a.localeCompare(b)));
  for (const m of metrics) {
    const series = runs.map((r, i) => ({ name: r.name, color: color(i), points: (r.evals || {})[m] || [] }));
    figures.push(figure(m === "core" ? "Eval tasks: CORE" : `Eval task: ${m}`, chart(`eval-${m}`, series, { xTitle: "step", yTitle: m === "core" ? "CORE" : "accuracy" }), series));
  }
  return [table, el("div", { class: "charts" }, figures)];
}

// ------------------------------------------------------------------------------------------- page
function serverNow() {
  return last ? last.state.now + (Date.now() - last.at) / 1000 : Date.now() / 1000;
}

function badge(src) {
  const age = isNum(src.fetched_at) ? serverNow() - src.fetched_at : null;
  if (src.error) return el("span", { class: "badge down", "data-age": age }, age === null ? "unreachable" : `unreachable · data ${ago(age)}`);
  if (age === null) return el("span", { class: "badge stale" }, "reading…");
  const stale = age > 3 * src.interval_s + 5;
  return el("span", { class: `badge${stale ? " stale" : ""}`, "data-age": age }, `${stale ? "stale" : "live"} · data ${ago(age)}`);
}

function render(state) {
  const main = document.getElementById("sources");
  const cards = state.sources.map((src) => {
    const body = src.kind === "swarm" ? renderSwarm(src) : renderRuns(src);
    return el("section", { class: `card ${src.kind}`, id: `source-${src.id}`, "data-kind": src.kind },
      el("div", { class: "head" }, el("h2", {}, `${src.kind === "swarm" ? "Swarm" : "Runs"} · ${src.label}`), badge(src)),
      src.error ? el("p", { class: "error", "data-error": "" }, `${src.kind === "swarm" ? "bus" : "folder"} unreachable: ${src.error}`) : null,
      body);
  });
  main.replaceChildren(...cards);
  document.getElementById("clock").textContent = `updated ${clock(state.now)}`;
}

function banner(text) {
  const node = document.getElementById("banner");
  node.hidden = !text;
  node.textContent = text || "";
}

async function poll() {
  let wait = 2000;
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const state = await response.json();
    last = { state, at: Date.now() };
    failingSince = null;
    banner("");
    render(state);
    const fastest = Math.min(...state.sources.map((s) => s.interval_s || 5));
    wait = Math.max(500, Math.min(5000, fastest * 1000));
  } catch (error) {
    failingSince = failingSince || Date.now();
    banner(`the dashboard server does not answer (since ${new Date(failingSince).toLocaleTimeString("en-GB", { hour12: false })}); showing the last data`);
    if (last) render(last.state);
  }
  setTimeout(poll, wait);
}

document.addEventListener("DOMContentLoaded", poll);
