// sglang-spex tree view: starts or attaches to a server-side search (or replays a result JSON) and draws its tree.
// Events: POST /tot/search {"stream": true} starts a search (its stream is held open: closing it cancels the
// search); GET /tot/ui/events/{id} describes the tree as it grows (view / state / frontier / answer / result).
// Events only change `ui`; the SVG is redrawn at most once per animation frame (and, for a big tree whose draw is
// slow, after as long again), so attaching to a search of N nodes costs a few draws, not N. A result, an ended
// stream and a replay draw at once.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const XSTEP = 34, YSTEP = 64, PAD = 24, R = 9;

const ui = {
  nodes: new Map(),      // path -> view {path, parent, kind, depth, text, status, show, ghost, reward, ...}
  frontier: new Set(),   // paths the last BFS frontier decision chose
  state: null,           // last `state` event (totals, SPEX accounting, T3)
  result: null,          // the final result (with `ui`: ghosts and adopted paths)
  searchId: null,
  controller: null,
  draws: 0,              // how many times the SVG was rebuilt (tests read it)
};
window.spexUI = ui;

// ---- helpers ------------------------------------------------------------------------------------------
function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setState(state, text) {
  document.body.dataset.state = state;
  $("status").textContent = text || state;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(digits === undefined ? 3 : digits);
  return String(x);
}

function mass(reward) {  // T3's vote weight of one answer (speculation/early_stop.py EarlyStop.weight)
  if (reward === null || reward === undefined || Number.isNaN(reward)) return 0;
  return reward < 0 ? Math.exp(reward) : reward;
}

function shownStatus(status, speculative) {  // mirrors ui/observer.py shown_status
  if (status === "failed" || status === "cancelled") return status;
  return speculative ? "adopted" : "primary";
}

function childOrder(path) {
  const last = path.slice(path.lastIndexOf(".") + 1);
  return last.startsWith("g") ? 1e6 + Number(last.slice(1)) : Number(last);
}

async function readSSE(response, onEvent) {  // resolves when the stream ends (comments, e.g. keep-alives, skipped)
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
      if (data) onEvent(JSON.parse(data));
    }
  }
}

// ---- drawing ------------------------------------------------------------------------------------------
const redraw = { pending: 0, next: 0, ms: 0 };  // pending: the scheduled draw's number (0: none); ms: last draw's cost

function requestDraw() {
  if (redraw.pending) return;
  const ticket = redraw.pending = ++redraw.next;
  const go = () => { if (redraw.pending === ticket) draw(); };
  // one draw per animation frame; a big tree's slow draw leaves as much time again to the events (at most 1 s)
  setTimeout(() => {
    if (typeof requestAnimationFrame === "function") requestAnimationFrame(go);
    setTimeout(go, 250);  // no animation frames in a hidden tab: a timer draws there
  }, Math.min(redraw.ms, 1000));
}

function layout() {
  const kids = new Map();
  for (const n of ui.nodes.values()) {
    if (n.parent === null) continue;
    const parent = ui.nodes.has(n.parent) ? n.parent : "r";
    if (!kids.has(parent)) kids.set(parent, []);
    kids.get(parent).push(n.path);
  }
  for (const list of kids.values()) list.sort((a, b) => childOrder(a) - childOrder(b));
  const pos = new Map();
  let next = 0;
  const place = (path, depth) => {
    const list = kids.get(path) || [];
    if (!list.length) { pos.set(path, { x: next++, y: depth }); return pos.get(path).x; }
    const xs = list.map((k) => place(k, depth + 1));
    pos.set(path, { x: (xs[0] + xs[xs.length - 1]) / 2, y: depth });
    return pos.get(path).x;
  };
  if (ui.nodes.has("r")) place("r", 0);
  return pos;
}

function showNode(n) {
  const lines = [
    `${n.path}  (${n.kind}, depth ${n.depth})`,
    `shown: ${n.show}${n.ghost ? " (speculative, not in the tree)" : ""}   engine: ${n.status}`,
    `reward: ${fmt(n.reward, 4)}   tokens: ${fmt(n.tokens)}   terminal: ${n.terminal}`,
  ];
  if (n.answer !== null && n.answer !== undefined) lines.push(`answer: ${n.answer}`);
  if (n.error) lines.push(`error: ${n.error}`);
  lines.push("", n.text || "(no text)");
  $("hover-body").textContent = lines.join("\n");
}

function draw() {  // the whole SVG and the panels, now (see requestDraw)
  redraw.pending = 0;
  ui.draws += 1;
  const began = performance.now();
  const svg = $("tree");
  const pos = layout();
  let maxX = 0, maxY = 0;
  for (const p of pos.values()) { maxX = Math.max(maxX, p.x); maxY = Math.max(maxY, p.y); }
  svg.setAttribute("width", 2 * PAD + maxX * XSTEP + 40);
  svg.setAttribute("height", 2 * PAD + maxY * YSTEP + 20);
  svg.replaceChildren();
  const at = (path) => { const p = pos.get(path); return [PAD + p.x * XSTEP, PAD + p.y * YSTEP]; };
  for (const n of ui.nodes.values()) {
    if (n.parent === null || !pos.has(n.path)) continue;
    const [x1, y1] = at(ui.nodes.has(n.parent) ? n.parent : "r"), [x2, y2] = at(n.path);
    const e = document.createElementNS(SVG, "path");
    e.setAttribute("d", `M${x1},${y1} C${x1},${(y1 + y2) / 2} ${x2},${(y1 + y2) / 2} ${x2},${y2}`);
    e.setAttribute("class", "edge" + (n.ghost ? " ghost" : ""));
    svg.appendChild(e);
  }
  for (const n of ui.nodes.values()) {
    if (!pos.has(n.path)) continue;
    const [x, y] = at(n.path);
    const c = document.createElementNS(SVG, "circle");
    c.setAttribute("cx", x); c.setAttribute("cy", y); c.setAttribute("r", n.kind === "rollout" ? R - 3 : R);
    const cls = ["node", "show-" + n.show, "status-" + n.status, "kind-" + n.kind];
    if (n.ghost) cls.push("ghost");
    if (n.parent === null) cls.push("root");
    if (ui.frontier.has(n.path)) cls.push("frontier");
    c.setAttribute("class", cls.join(" "));
    c.dataset.path = n.path;  // hovered: see the svg's mouseover listener below
    const title = document.createElementNS(SVG, "title");
    title.textContent = `${n.path} [${n.show}] reward=${fmt(n.reward, 3)}\n${n.text || ""}`;
    c.appendChild(title);
    svg.appendChild(c);
    const label = n.answer !== null && n.answer !== undefined && n.status === "done" ? n.answer : fmt(n.reward, 2);
    if (n.parent !== null && label !== "–") {
      const t = document.createElementNS(SVG, "text");
      t.setAttribute("x", x + R + 2); t.setAttribute("y", y + 3);
      t.setAttribute("class", "label" + (n.answer !== null && n.answer !== undefined ? " answer" : ""));
      t.textContent = label;
      svg.appendChild(t);
    }
  }
  drawPanels();
  redraw.ms = performance.now() - began;
}

$("tree").addEventListener("mouseover", (e) => {
  const path = e.target.dataset && e.target.dataset.path;
  if (path && ui.nodes.has(path)) showNode(ui.nodes.get(path));
});

function row(table, cells, cls) {
  const tr = table.insertRow();
  if (cls) tr.className = cls;
  cells.forEach((v, i) => { const td = tr.insertCell(); td.textContent = v; if (i) td.className = "num"; });
}

function drawPanels() {
  // answers with their vote mass (T3's weighting), grouped by the vote's key (``vote_key``: "1,000" and "1000" are
  // one answer; a saved result without it groups by spelling), each spelling shown; the search's answer marked
  const votes = new Map();
  for (const n of ui.nodes.values()) {
    if (n.ghost || n.kind !== "step" || n.status !== "done" || n.answer === null || n.answer === undefined) continue;
    const key = n.vote_key ?? n.answer;
    const v = votes.get(key) || { count: 0, mass: 0, spellings: [] };
    v.count += 1; v.mass += mass(n.reward);
    if (!v.spellings.includes(n.answer)) v.spellings.push(n.answer);
    votes.set(key, v);
  }
  const answers = $("answers");
  answers.replaceChildren();
  row(answers, ["answer", "paths", "mass"]);
  const final = ui.result ? ui.result.answer : null;
  [...votes.values()].sort((a, b) => b.mass - a.mass).forEach((v) => {
    const won = final !== null && v.spellings.includes(final);
    const mark = won ? (ui.result.correct === true ? " ✓" : ui.result.correct === false ? " ✗" : " ←") : "";
    row(answers, [v.spellings.join(" = ") + mark, v.count, fmt(v.mass, 3)], won ? "winner" : "");
  });

  const st = ui.state || {};
  const t3 = st.t3;
  const stop = ui.result ? ui.result.stop_reason : st.stop_reason;
  let t3text = "baseline search (no SPEX context): no T3";
  if (t3 && !t3.enabled) t3text = "off for this search (--tot-early-stop / speculation.early_stop)";
  if (t3 && t3.enabled) {
    const m = Object.values(t3.mass).sort((a, b) => b - a).concat([0, 0]);
    const total = Object.values(t3.mass).reduce((a, b) => a + b, 0);
    const lead = total > 0 ? (m[0] - m[1]) / total : 0;
    t3text = `answers ${t3.answers} (needs ${t3.min_answers}); top-1 lead ${fmt(lead, 3)} of the mass vs α=${t3.alpha}: `;
    t3text += t3.stopped_answer !== null ? `STOPPED early → ${t3.stopped_answer}` : "continue";
  }
  if (stop) t3text += `\nstop reason: ${stop}`;
  if (ui.result && ui.result.error) t3text += `\nerror: ${ui.result.error}`;
  $("t3").textContent = t3text;

  const acc = $("accounting");
  acc.replaceChildren();
  const res = ui.result;
  const drawn = [...ui.nodes.values()];
  row(acc, ["nodes in the tree", drawn.filter((n) => !n.ghost).length]);
  row(acc, ["speculative nodes outside it", drawn.filter((n) => n.ghost).length]);
  row(acc, ["tokens generated", fmt(res ? res.tokens_generated : st.tokens_generated)]);
  row(acc, ["requests", fmt(res ? res.num_requests : st.num_requests)]);
  if (!res) row(acc, ["in flight", fmt(st.inflight)]);
  if (res) row(acc, ["wall time (s)", fmt(res.wall_time, 2)]);
  const spec = res && res.speculation ? res.speculation : st.accounting;
  if (spec) {
    row(acc, ["speculative issued", spec.issued]);
    row(acc, ["hits (adopted)", `${spec.hits} / ${spec.issued}`]);
    row(acc, ["adopted in flight", spec.in_flight_adopted]);
    row(acc, ["cancelled", spec.cancelled]);
    row(acc, ["never used", spec.never_used]);
    row(acc, ["speculative tokens", spec.spec_tokens]);
    row(acc, ["wasted tokens", spec.wasted_tokens]);
  } else {
    row(acc, ["speculation", "off"]);
  }
}

// ---- events -------------------------------------------------------------------------------------------
function onEvent(ev) {
  if (ev.event === "view") ui.nodes.set(ev.node.path, ev.node);
  else if (ev.event === "state") ui.state = ev;
  else if (ev.event === "frontier") ui.frontier = new Set(ev.chosen.map((c) => c[0]));
  else if (ev.event === "result") return finish(Object.assign({}, ev.result, { ui: ev.ui }));
  requestDraw();
}

function finish(result) {  // the search's result is in: draw its final state now
  ui.result = result;
  ui.frontier = new Set();
  draw();
  const blob = new Blob([JSON.stringify(result, null, 1)], { type: "application/json" });
  const link = $("download");
  if (link.href.startsWith("blob:")) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(blob);
  link.hidden = false;
  let text = `${result.status}: answer ${fmt(result.answer)}` + (result.correct === null || result.correct === undefined ? "" : result.correct ? " ✓" : " ✗");
  if (result.error) text += ` (error: ${result.error})`;
  setState("done", text);
}

function ended(searchId, why) {  // the stream closed before the result: say so, offer to attach again
  draw();
  const again = $("again");
  again.href = `/tot/ui?search=${encodeURIComponent(searchId)}`;
  again.hidden = false;
  setState("ended", `${searchId}: ${why}; the search may still be running: attach again`);
}

function failedState(e, searchId) {
  if (e instanceof TypeError && searchId) return ended(searchId, `connection lost (${e.message}); the server may have stopped`);
  setState("error", String(e.message || e));
}

function reset(searchId) {
  if (ui.controller) ui.controller.abort();
  ui.controller = new AbortController();
  ui.nodes = new Map(); ui.frontier = new Set(); ui.state = null; ui.result = null; ui.searchId = searchId;
  $("download").hidden = true;
  $("again").hidden = true;
  draw();
}

class Refused extends Error {}  // the events route answered with an error status (429 / 404 / 401)

async function watch(searchId, wait, controller) {  // true if the stream brought the result
  const url = `/tot/ui/events/${encodeURIComponent(searchId)}` + (wait ? `?wait=${wait}` : "");
  const r = await fetch(url, { headers: headers(), signal: controller.signal });
  if (!r.ok) throw new Refused(`events: HTTP ${r.status} ${await r.text()}`);
  if (!ui.result) setState("running", `running ${searchId}`);
  await readSSE(r, onEvent);
  return ui.result !== null;
}

function cancelSearch(searchId, controller) {  // closes the search's stream (the server cancels it) and says so
  controller.abort();
  fetch(`/tot/search/${encodeURIComponent(searchId)}`, { method: "DELETE", headers: headers(), keepalive: true })
    .catch(() => {});
}

async function start(ev) {
  ev.preventDefault();
  let spec;  // parsed first: a typo must not cancel the search this tab is showing
  try { spec = JSON.parse($("spec").value); } catch (e) { return setState("error", "spec JSON: " + e.message); }
  const searchId = "ui" + Math.random().toString(36).slice(2, 12);
  reset(searchId);
  const body = { spec, question: $("question").value, stream: true, search_id: searchId };
  if ($("reference").value.trim()) body.reference = $("reference").value.trim();
  setState("running", "starting");
  const controller = ui.controller;
  let refused = null, posted = null;
  // subscribed before the search starts; if the subscription is refused, nobody would see the search: cancel it
  const watching = watch(searchId, 10, controller).catch((e) => {
    if (e instanceof Refused && !controller.signal.aborted) { refused = e; cancelSearch(searchId, controller); }
    return e;
  });
  try {
    const r = await fetch("/tot/search", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      controller.abort();
      throw new Error("refused: " + JSON.stringify(e.error || r.status));
    }
    // held open: closing this stream cancels the search; its own `result` is the fallback for the tree view's
    const search = readSSE(r, (e) => { if (e.event === "result") posted = e; }).then(() => null, (e) => e);
    const watched = await watching;
    if (refused) throw refused;
    if (controller.signal.aborted) return;  // another start / attach / replay took the page
    if (watched instanceof Error) setState("running", `running ${searchId} (tree view stream lost: ${watched.message}; the tree is drawn from the result)`);
    const lost = await search;
    if (controller.signal.aborted || ui.result) return;
    if (posted) return applyResult(Object.assign({}, posted.result, { ui: posted.ui }), false);
    if (lost) throw lost;
    ended(searchId, "both streams ended without a result");
  } catch (e) {
    if (refused) setState("error", `${refused.message}: the search was cancelled (nobody could watch it)`);
    else if (e.name !== "AbortError") failedState(e, searchId);
  }
}

async function attach(ev) {
  ev.preventDefault();
  const id = $("attach-id").value.trim();
  if (!id) return;
  reset(id);
  const controller = ui.controller;
  try {
    const got = await watch(id, 0, controller);
    if (!got && !controller.signal.aborted) ended(id, "the stream ended before the result");
  } catch (e) {
    if (e.name !== "AbortError") failedState(e, id);
  }
}

function applyResult(result, fresh) {  // draw a result's tree (fresh: only it; else over the ghosts drawn so far)
  if (fresh) reset(result.search_id);
  const adopted = new Set((result.ui && result.ui.adopted) || []);
  for (const n of result.nodes) {
    const speculative = adopted.has(n.path) || Boolean(n.speculative);
    ui.nodes.set(n.path, Object.assign({}, n, { show: shownStatus(n.status, speculative), ghost: false }));
  }
  for (const g of (result.ui && result.ui.ghosts) || []) ui.nodes.set(g.path, g);
  finish(result);
}

// A saved result: the page's download (the result plus `ui`), a plain SearchResult.to_dict() (POST /tot/search),
// a GET /tot/search/{id} body or a `result` event (the result under "result").
function replay(saved) {
  let result = saved;
  if (saved && !Array.isArray(saved.nodes) && saved.result !== undefined) {
    if (saved.result === null) throw new Error(`search ${saved.search_id} has no result yet (status ${saved.status})`);
    result = Object.assign({ ui: saved.ui }, saved.result);
  }
  if (!result || !Array.isArray(result.nodes)) throw new Error("not a search result (no `nodes`)");
  applyResult(result, true);
}
window.spexReplay = replay;

async function replayFile() {
  const f = $("replay-file").files[0];
  if (!f) return;
  try { replay(JSON.parse(await f.text())); } catch (e) { setState("error", "replay: " + e.message); }
}

// ---- the form -----------------------------------------------------------------------------------------
function writeSpec() {
  const reward = $("reward").value === "arith" ? { type: "verifier", name: "arith" } : { type: "logprob" };
  const spec = {
    policy: $("policy").value,
    step: { max_tokens: 48, stop: ["\n"], temperature: 0.8, max_total_tokens: 192 },
    reward, seed: Number($("seed").value) || 0,
    speculation: { enabled: $("speculation").value === "on" },
  };
  $("spec").value = JSON.stringify(spec, null, 1);
}

for (const id of ["policy", "reward", "speculation", "seed"]) $(id).addEventListener("change", writeSpec);
$("start-form").addEventListener("submit", start);
$("attach-form").addEventListener("submit", attach);
$("replay-file").addEventListener("change", replayFile);
writeSpec();
const params = new URLSearchParams(location.search);
if (params.get("search")) { $("attach-id").value = params.get("search"); attach(new Event("submit")); }
else draw();
