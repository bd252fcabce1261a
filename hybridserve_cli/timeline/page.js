// The timeline page: draws the view model that `hybridserve timeline` embedded as JSON (see view.py)
// as SVG markup strings. Plain JS, no libraries, no network: the page works opened from disk.
"use strict";

const data = JSON.parse(document.getElementById("timeline-data").textContent);
const CHART_H = 110, MARK_H = 14, AXIS_H = 30, LANE_H = 18, LABEL_W = 210;
const tips = [];  // tooltip texts; elements carry data-tip = index
let axis = "step", selected = -1, scale = null;

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const sec = (t) => `+${t.toFixed(3)} s`;
const ms = (t) => `${(t * 1000).toFixed(1)} ms`;
const tip = (text) => `data-tip="${tips.push(text) - 1}"`;

function makeScale() {
  const n = data.steps.length;
  const lastT = Math.max(0.001, ...data.steps.map((s) => s.end_s),
    ...data.lanes.flatMap((l) => l.marks.map((m) => m.t_s)));
  const width = Math.max(480, n * Math.max(6, Math.min(28, 1150 / Math.max(n, 1))));
  const end = axis === "step" ? Math.max(n, 1) : lastT;
  return { width: width + 60, x: (pos, t) => (axis === "step" ? pos : t) / end * width };
}

function flags(s) {
  const out = [];
  if (s.stalled) out.push("stalled");
  if (s.micro_sliced) out.push("micro-sliced");
  if (s.preempted_request_ids.length) out.push(`preempting ${s.preempted_request_ids.join(", ")}`);
  return out;
}

function stepTip(s) {
  return [`step ${s.step_index}  ${sec(s.start_s)} .. ${sec(s.end_s)} (${ms(s.end_s - s.start_s)})`,
    `decode ${s.num_decode_tokens} + prefill ${s.num_prefill_tokens} of ${s.budget_tokens} tokens`,
    ...(s.num_draft_tokens ? [`drafts ${s.num_draft_tokens}: ${s.num_accepted_tokens} accepted, ${s.num_draft_tokens - s.num_accepted_tokens} rejected`] : []),
    `prefill budget ${s.prefill_budget_tokens}, micro budget ${s.micro_budget_tokens || "off"}, quantum ${s.quantum}`,
    ...(s.prefill_share_target >= 0 ? [`prefill share ${s.prefill_share.toFixed(3)} of target ${s.prefill_share_target.toFixed(3)}`] : []),
    `running ${s.num_running}, waiting ${s.num_waiting}, free KV pages ${s.num_free_kv_pages}`,
    ...(s.skipped_request_ids.length ? [`skipped (finished before the step): ${s.skipped_request_ids.join(", ")}`] : []),
    ...flags(s), `replay: ${replayWord(s)}`].join("\n");
}

function replayWord(s) {
  return s.reproduces === null ? "no recorded plan" : s.reproduces ? "identical" : "DIFFERS";
}

function axisRow() {
  let out = "", lastX = -1e9;
  for (const s of data.steps) {
    const x = scale.x(s.position, s.start_s);
    if (x - lastX < 64) continue;
    lastX = x;
    out += `<line class="tickline" x1="${x}" x2="${x}" y1="0" y2="${AXIS_H}"/>` +
      `<text class="tick" x="${x + 2}" y="11">#${s.step_index}</text>` +
      `<text class="tick" x="${x + 2}" y="24">${sec(s.start_s)}</text>`;
  }
  return row(`<span class="label head">step index / time</span>`, AXIS_H, out, "");
}

function chartRow() {
  let out = "";
  for (const s of data.steps) {
    const x0 = scale.x(s.position, s.start_s), w = Math.max(1, scale.x(s.position + 1, s.end_s) - x0 - 1);
    const h = (n) => (n > 0 ? Math.min(CHART_H, Math.max(2, (n / Math.max(s.budget_tokens, 1)) * CHART_H)) : 0);
    const dh = h(s.num_decode_tokens), ph = h(s.num_prefill_tokens), top = MARK_H, base = MARK_H + CHART_H;
    let marks = "", mx = x0;
    for (const [on, cls, label] of [[s.stalled, "stalled", "stalled"], [s.micro_sliced, "micro", "micro-sliced"],
      [s.preempted_request_ids.length, "preempt", "preempting"]]) {
      if (on) { marks += `<rect class="${cls}" x="${mx}" y="1" width="${Math.min(w, 8)}" height="10"><title>${label}</title></rect>`; mx += Math.min(w, 8) + 1; }
    }
    const micro = s.micro_budget_tokens ? base - h(s.num_decode_tokens + s.micro_budget_tokens) : -1;
    out += `<g class="step" data-step="${s.step_index}" data-pos="${s.position}" ${tip(stepTip(s))}>` +
      `<rect class="budget" x="${x0}" y="${top}" width="${w}" height="${CHART_H}"/>` +
      `<rect class="decode" x="${x0}" y="${base - dh}" width="${w}" height="${dh}"/>` +
      `<rect class="prefill" x="${x0}" y="${base - dh - ph}" width="${w}" height="${ph}"/>` +
      (micro >= top ? `<line class="mbudget" x1="${x0}" x2="${x0 + w}" y1="${micro}" y2="${micro}"/>` : "") +
      marks + "</g>";
  }
  const budgets = [...new Set(data.steps.map((s) => s.budget_tokens))].join("/");
  return row(`<span class="label head">tokens per step<br>of budget ${esc(budgets)}<br>(dashed: micro budget)</span>`,
    MARK_H + CHART_H, out, "");
}

function segTip(lane, g) {
  const what = { queued: "queued", idle: "running, but given no tokens (no budget or no KV pages)" }[g.kind];
  if (what) return `${lane.request_id}\n${what}\n${sec(g.start_s)} .. ${sec(g.end_s)} (${ms(g.end_s - g.start_s)})`;
  return [`${lane.request_id}  step ${g.step_index}`,
    `${g.kind} ${g.token_end - g.token_start} token(s) [${g.token_start}, ${g.token_end})`,
    ...(g.kind === "prefill" ? [`ends on checkpoint: ${g.ends_on_checkpoint ? "yes" : "no"}, crosses ${g.num_grid_boundaries} block boundary(ies)`] : []),
    `${sec(g.start_s)} .. ${sec(g.end_s)}`].join("\n");
}

function laneRow(lane) {
  let out = "", lastX = 0;
  for (const g of lane.segments) {
    const x0 = scale.x(g.start_pos, g.start_s), x1 = scale.x(g.end_pos, g.end_s);
    const thin = g.kind === "queued" || g.kind === "idle";
    const w = Math.max(thin ? 0 : 1, x1 - x0 - (thin ? 0 : 1));
    const y = thin ? 6 : 3, hh = thin ? 6 : LANE_H - 6;
    out += `<rect class="seg ${g.kind}" data-step="${g.step_index}" x="${x0}" y="${y}" width="${w}" height="${hh}" ${tip(segTip(lane, g))}/>`;
    if (g.ends_on_checkpoint) out += `<line class="ckpt" x1="${x0 + w}" x2="${x0 + w}" y1="1" y2="${LANE_H - 1}" ${tip(`${lane.request_id}\ncheckpoint at token ${g.token_end} (step ${g.step_index})`)}/>`;
    lastX = Math.max(lastX, x0 + w);
  }
  for (const m of lane.marks) {
    const x = scale.x(m.pos, m.t_s);
    if (m.kind === "preempted") out += `<path class="preempt" d="M${x - 5},1 L${x + 5},1 L${x},10 Z" ${tip(`${lane.request_id}\npreempted in step ${m.label} at ${sec(m.t_s)}`)}/>`;
    if (m.kind === "first_token") out += `<circle class="first" cx="${x}" cy="${LANE_H / 2}" r="3.5" ${tip(`${lane.request_id}\nfirst token at ${sec(m.t_s)}`)}/>`;
    if (m.kind === "finished") {
      out += `<line class="finish" x1="${x}" x2="${x}" y1="2" y2="${LANE_H - 2}" ${tip(`${lane.request_id}\nfinished (${m.label}) at ${sec(m.t_s)}`)}/>` +
        `<text class="reason" x="${Math.max(x, lastX) + 4}" y="${LANE_H - 5}">${esc(m.label)}</text>`;
    }
  }
  const label = `<span class="label" ${tip(laneTip(lane))}>${esc(lane.request_id)}</span>`;
  return row(label, LANE_H, out, `lane" data-request-id="${esc(lane.request_id)}`);
}

function laneTip(l) {
  const finish = l.finish_reason ? `finished: ${l.finish_reason}, ${l.completion_tokens} token(s) generated` : "did not finish within the recording";
  return `${l.request_id}\nprompt ${l.prompt_tokens} token(s), cached ${l.cached_tokens}\n${finish}\ntrace ${l.trace_id || "not recorded"}`;
}

function row(label, height, svg, cls) {
  return `<div class="row ${cls}">${label}<svg width="${scale.width}" height="${height}">${svg}</svg></div>`;
}

function render() {
  tips.length = 0;
  scale = makeScale();
  $("chart").innerHTML = `<div id="cursor" hidden></div>` + axisRow() + chartRow() +
    `<div id="lanes">${data.lanes.map(laneRow).join("")}</div>`;
  filter();
  if (selected >= 0) select(selected);
}

function traceLink(id) {
  if (!id) return "not recorded";
  if (!data.jaeger_url) return `<code>${esc(id)}</code>`;
  return `<a href="${esc(data.jaeger_url)}/trace/${esc(id)}" target="_blank" rel="noopener">${esc(id)}</a>`;
}

function select(k) {
  const s = data.steps[k];
  if (!s) return;
  selected = k;
  const cursor = $("cursor"), x0 = scale.x(s.position, s.start_s), x1 = scale.x(s.position + 1, s.end_s);
  Object.assign(cursor.style, { left: `${LABEL_W + x0}px`, width: `${Math.max(2, x1 - x0)}px` });
  cursor.hidden = false;
  const badges = flags(s).map((f) => `<span class="badge" style="background:${f.startsWith("stalled") ? "#e45756" : f.startsWith("micro") ? "#72b7b2" : "#7b3294"}">${esc(f)}</span>`).join("");
  const replay = s.reproduces === null ? `<span class="bad">no recorded plan to compare</span>`
    : s.reproduces ? `<span class="ok">replay reproduces the recorded plan (identical)</span>`
      : `<span class="bad">replay DIFFERS from the recorded plan (diff below)</span>`;
  $("details").innerHTML = `<h2 id="selected-step" data-step="${s.step_index}">step ${s.step_index}${badges}</h2>` +
    `<p>${replay} · trace ${traceLink(s.trace_id)} · ${sec(s.start_s)} .. ${sec(s.end_s)} (${ms(s.end_s - s.start_s)}),` +
    ` plan latency ${ms(s.plan_latency_s)}</p>` +
    (s.skipped_request_ids.length ? `<p>The worker skipped what this plan says of ${esc(s.skipped_request_ids.join(", "))}:` +
      " finished before the step ran (the plan was made one step ahead).</p>" : "") +
    `<p class="hint">as printed by <code>hybridserve replay ${esc(data.source)} --step ${s.step_index}</code>:</p>` +
    `<pre id="plan">${esc(s.plan_text)}</pre>`;
}

function showRequest(id) {
  const l = data.lanes.find((x) => x.request_id === id);
  if (!l) return;
  const rows = l.segments.map((g) => `<tr><td>${g.kind === "idle" ? "running, no tokens" : g.kind}</td><td>${g.step_index >= 0 ? g.step_index : ""}</td><td>${g.kind === "queued" ? "" : `[${g.token_start}, ${g.token_end})`}</td><td>${g.ends_on_checkpoint ? "checkpoint" : ""}</td><td>${sec(g.start_s)} .. ${sec(g.end_s)}</td></tr>`).join("");
  $("details").innerHTML = `<h2 id="selected-request">request ${esc(l.request_id)}</h2>` +
    `<p>trace ${traceLink(l.trace_id)} · prompt ${l.prompt_tokens} token(s), cached ${l.cached_tokens} · ` +
    `${l.finish_reason ? `finished: ${esc(l.finish_reason)}, ${l.completion_tokens} generated` : "did not finish within the recording"} · ` +
    `${l.marks.filter((m) => m.kind === "preempted").length} preemption(s)</p>` +
    `<table><tr><th>kind</th><th>step</th><th>tokens</th><th></th><th>time</th></tr>${rows}</table>`;
}

function filter() {
  const q = $("search").value.trim().toLowerCase();
  let shown = 0;
  for (const lane of document.querySelectorAll(".lane")) {
    const on = !q || lane.dataset.requestId.toLowerCase().includes(q);
    lane.style.display = on ? "" : "none";
    shown += on;
  }
  const st = data.steps, count = (f) => st.filter(f).length;
  const differ = count((s) => s.reproduces === false);
  $("summary").textContent = `${data.source}: ${st.length} steps, ${shown} of ${data.lanes.length} requests · ` +
    `${count((s) => s.stalled)} stalled, ${count((s) => s.micro_sliced)} micro-sliced, ` +
    `${count((s) => s.preempted_request_ids.length)} preempting · replay: ${differ ? `${differ} differ` : "all identical"}`;
}

function onHover(e) {
  const t = e.target.closest("[data-tip]"), box = $("tip");
  if (!t) { box.hidden = true; return; }
  box.textContent = tips[Number(t.dataset.tip)];
  box.hidden = false;
  box.style.left = `${Math.min(e.clientX + 12, window.innerWidth - box.offsetWidth - 8)}px`;
  box.style.top = `${Math.min(e.clientY + 14, window.innerHeight - box.offsetHeight - 8)}px`;
}

function onClick(e) {
  const step = e.target.closest("[data-step]");
  const lane = e.target.closest(".lane");
  if (e.target.closest(".label") && lane) showRequest(lane.dataset.requestId);
  else if (step && step.dataset.pos !== undefined) select(Number(step.dataset.pos));
  else if (step && Number(step.dataset.step) >= 0) select(data.steps.findIndex((s) => s.step_index === Number(step.dataset.step)));
}

function initialStep() {
  const m = /step=(\d+)/.exec(location.hash);
  if (m) return data.steps.findIndex((s) => s.step_index === Number(m[1]));
  const notable = data.steps.findIndex((s) => s.stalled || s.preempted_request_ids.length || s.reproduces === false);
  return notable >= 0 ? notable : data.steps.length ? 0 : -1;
}

document.addEventListener("mousemove", onHover);
$("chart").addEventListener("click", onClick);
$("search").addEventListener("input", filter);
for (const r of document.querySelectorAll("input[name=axis]")) r.addEventListener("change", () => { axis = r.value; render(); });
const query = /[#&]q=([^&]*)/.exec(location.hash);
if (query) $("search").value = decodeURIComponent(query[1]);
if (/axis=time/.test(location.hash)) { axis = "time"; document.querySelector("input[value=time]").checked = true; }
selected = initialStep();
render();
const shown = /[#&]request=([^&]*)/.exec(location.hash);
if (shown) showRequest(decodeURIComponent(shown[1]));
