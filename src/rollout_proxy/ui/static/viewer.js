// The trajectory viewer: three views over the proxy's admin read API, plain DOM, no build step.
//   #/?filters          sessions, newest first (GET /v1/admin/sessions)
//   #/session/ID        a session's response tree (GET /v1/admin/sessions/ID)
//   #/tokens/RESP_ID    a trajectory's tokens (GET /v1/admin/responses/RESP_ID/tokens), each image's span
//                       drawn as the image (GET /v1/sessions/ID/images/SHA256)
// Every value from the API reaches the page as text (textContent), never as HTML.
"use strict";

const KEY_STORE = "rollout-proxy-admin-key";
const SCANS_PER_CLICK = 5; // listing requests per page shown, at most
const FILTERS = ["status", "job", "finish_reason", "forks", "drift", "policy", "policy_version", "graded", "min_reward", "max_reward", "limit"];

// Token colours. weight: the loss weight (0 or 1); logprob: exp(logprob) from red (0) to green (1),
// for tokens the policy sampled; advantage: red below 0, green above, by |a| / max |a|.
const COLOURS = {
  weightZero: "rgb(229, 231, 235)",
  weightOne: "rgb(187, 247, 208)",
  unsampled: "rgb(229, 231, 235)",
  probability: (p) => `hsl(${Math.round(120 * Math.min(1, Math.max(0, p)))}, 75%, 78%)`,
  advantage: (a, scale) => {
    const t = scale > 0 ? Math.min(1, Math.abs(a) / scale) : 0;
    return `hsl(${a >= 0 ? 135 : 0}, 70%, ${Math.round(96 - 26 * t)}%)`;
  },
};

let adminKey = sessionStorage.getItem(KEY_STORE) || "";

// -- small helpers ----------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const shortId = (id) => (id ? id.slice(-8) : "");
const when = (seconds) => (seconds ? new Date(seconds * 1000).toLocaleString() : "");
const number = (value, digits = 4) => (value === null || value === undefined ? "—" : Number(value).toFixed(digits));
const view = () => document.getElementById("view");

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${adminKey}` }, cache: "no-store" });
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON: the status says enough */ }
  if (!response.ok) throw new ApiError(response.status, (body && body.error && body.error.message) || response.statusText);
  return body;
}

// An image of a session as a thumbnail: fetched with the key (an <img> cannot send it), shown as a data: URL
// (the page's Content-Security-Policy takes images from the proxy and data: only).
function imageThumb(sessionId, image) {
  const img = el("img", { class: "thumb", alt: `image ${shortId(image.sha256)}`, "data-image": image.sha256 });
  fetch(`/v1/sessions/${encodeURIComponent(sessionId)}/images/${image.sha256}`, { headers: { Authorization: `Bearer ${adminKey}` } })
    .then(async (response) => {
      if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
      const blob = await response.blob();
      const reader = new FileReader();
      reader.onload = () => { img.src = reader.result; };
      reader.readAsDataURL(blob);
    })
    .catch((error) => { img.alt = `image ${shortId(image.sha256)} not loaded: ${error.message}`; img.classList.add("missing"); });
  return img;
}

function crumbs(...parts) {
  document.getElementById("crumbs").replaceChildren(...parts.flatMap((part, i) => (i ? [" / ", part] : [part])));
}

function notes(body) {
  const found = [];
  if (body.grades_error) found.push(el("p", { class: "note warn", text: body.grades_error }));
  if (body.feed === false) found.push(el("p", { class: "note", text: "This proxy reads no trainer feed (--feed): no rewards or advantages." }));
  return found;
}

// -- the admin key ----------------------------------------------------------------------------

function askForKey(problem) {
  const form = document.getElementById("key-form").content.firstElementChild.cloneNode(true);
  if (problem) { const p = form.querySelector(".problem"); p.textContent = problem; p.hidden = false; }
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    adminKey = form.elements.key.value.trim();
    sessionStorage.setItem(KEY_STORE, adminKey);
    route();
  });
  crumbs();
  view().replaceChildren(form);
  document.getElementById("forget").hidden = true;
}

function takeKeyFromAddress() {
  const match = /^#key=([^&]+)/.exec(location.hash);
  if (!match) return;
  adminKey = decodeURIComponent(match[1]);
  sessionStorage.setItem(KEY_STORE, adminKey);
  history.replaceState(null, "", `${location.pathname}#/`); // the key leaves the address bar and history
}

// -- sessions ---------------------------------------------------------------------------------

function filterForm(params) {
  const choice = (name, options) => el("select", { name },
    options.map(([value, label]) => el("option", { value, selected: params.get(name) === value || (!params.get(name) && !value) }, label)));
  const text = (name, placeholder, wide) => el("input", { name, placeholder, value: params.get(name) || "", class: wide ? "wide" : null });
  const field = (label, input) => el("label", {}, label, input);
  const yesNo = [["", "any"], ["true", "yes"], ["false", "no"]];
  const form = el("form", { class: "filters card", id: "filters" },
    field("status", choice("status", [["", "any"], ["open", "open"], ["finished", "finished"]])),
    field("job", text("job", "job id", true)),
    field("finish reason", text("finish_reason", "stop, length, …")),
    field("forks", choice("forks", yesNo)),
    field("drift", choice("drift", yesNo)),
    field("policy", text("policy", "base, a LoRA policy")),
    field("policy version", text("policy_version", "3, pol@v3")),
    field("graded", choice("graded", yesNo)),
    field("reward ≥", text("min_reward", "min")),
    field("reward ≤", text("max_reward", "max")),
    el("button", { type: "submit" }, "Filter"),
    el("button", { type: "button", onclick: () => { location.hash = "#/"; } }, "Clear"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = new URLSearchParams();
    for (const [name, value] of new FormData(form)) if (String(value).trim()) chosen.set(name, String(value).trim());
    location.hash = `#/?${chosen}`;
  });
  return form;
}

function sessionRow(item) {
  const reward = item.rewards.filter((value) => value !== null);
  const jobLink = item.job_id ? el("a", { href: `#/?job=${encodeURIComponent(item.job_id)}`, text: item.job_id }) : "";
  return el("tr", { "data-session": item.session_id },
    el("td", { text: when(item.created_at) }),
    el("td", {}, el("a", { class: "mono", href: `#/session/${item.session_id}`, text: item.session_id })),
    el("td", {}, jobLink),
    el("td", { text: item.step ?? "" }),
    el("td", {}, el("span", { class: `badge ${item.status}`, text: item.status }), item.result_status ? ` ${item.result_status}` : ""),
    el("td", { text: item.status === "finished" ? item.turns : "" }),
    el("td", { text: item.status === "finished" ? `${item.generated_tokens} / ${item.tokens}` : "" }),
    el("td", {}, item.finish_reasons.map((reason) => el("span", { class: "badge reason", text: reason }))),
    el("td", { text: item.forks || "" }),
    el("td", { text: item.routing_disagreements + item.nonfinite_logprobs || "" }),
    el("td", { text: item.policy || "base" }),
    el("td", { text: item.policy_versions.join(", ") }),
    el("td", { text: reward.length ? reward.map((value) => number(value, 3)).join(", ") : "" }));
}

async function showSessions(params) {
  crumbs(el("span", { text: "sessions" }));
  const table = el("table", { class: "sessions" },
    el("thead", {}, el("tr", {}, ["created", "session", "job", "step", "status", "turns", "generated / tokens",
      "finish", "forks", "drift", "policy", "versions", "reward"].map((name) => el("th", { text: name })))),
    el("tbody"));
  const jobs = el("div", { class: "chips" });
  const seenJobs = new Map();
  const more = el("button", { class: "more", type: "button", hidden: true }, "More");
  const info = el("div");
  view().replaceChildren(filterForm(params), info, jobs, table, more);
  let cursor = null;
  const wanted = Number(params.get("limit")) || 50;
  async function load() {
    // a rare filter answers short pages (each request scans a bounded stretch): go on a few times
    let found = 0;
    for (let request = 0; request < SCANS_PER_CLICK && found < wanted; request += 1) {
      const query = new URLSearchParams();
      for (const name of FILTERS) if (params.get(name)) query.set(name, params.get(name));
      if (cursor) query.set("cursor", cursor);
      const page = await api(`/v1/admin/sessions?${query}`);
      info.replaceChildren(...notes(page));
      table.tBodies[0].append(...page.data.map(sessionRow));
      found += page.data.length;
      for (const item of page.data) if (item.job_id) seenJobs.set(item.job_id, (seenJobs.get(item.job_id) || 0) + 1);
      cursor = page.next;
      if (!cursor) break;
    }
    jobs.replaceChildren(...(seenJobs.size ? [el("span", { class: "note", text: "jobs:" })] : []),
      ...[...seenJobs].map(([job, count]) => el("a", { class: "chip", href: `#/?job=${encodeURIComponent(job)}`, text: `${job} (${count})` })));
    more.hidden = !cursor;
    if (!table.tBodies[0].rows.length) info.append(el("p", { class: "note", text: cursor ? "None yet: press More to look further back." : "No live session matches." }));
  }
  more.addEventListener("click", () => load().catch(failed));
  await load();
}

// -- a session's tree -------------------------------------------------------------------------

function messageView(message, place) {
  const calls = (message.tool_calls || []).map((call) =>
    el("div", { class: "call", text: `→ ${call.function.name}(${call.function.arguments})` }));
  let content = message.content;
  if (Array.isArray(content)) content = content.map((part) => part.text || (part.type === "image" ? `[image ${shortId(part.image)}]` : "")).join("\n");
  const reasoning = message.reasoning_content || message.reasoning;
  return el("div", { class: `msg ${place}` },
    el("span", { class: "role", text: message.role }),
    message.tool_call_id ? el("span", { class: "note", text: `(${message.tool_call_id}) ` }) : "",
    reasoning ? el("details", {}, el("summary", { text: "reasoning" }), el("div", { class: "text", text: reasoning })) : "",
    content ? el("span", { class: "text", text: content }) : "",
    calls);
}

function branchBadge(branch) {
  if (!branch || branch.kind === "continuation") return branch && branch.label ? el("span", { class: "badge branch", text: branch.label }) : "";
  const where = branch.kind === "rewrite" ? ` of ${shortId(branch.from)} at message ${branch.at_message}`
    : branch.kind === "retry" ? ` of ${shortId(branch.from)}` : "";
  return el("span", { class: `badge branch ${branch.kind}`, title: branch.from || "" },
    `${branch.kind.replace("_", " ")}${where}${branch.label ? ` · ${branch.label}` : ""}`);
}

function trainedIn(node, sequences) {
  if (node.kind !== "generated") return "";
  const index = sequences.findIndex((s) => s.trained.includes(node.id));
  if (index < 0) return el("span", { class: "badge fork", text: "not trained (a dropped retry)" });
  const s = sequences[index];
  return el("span", { class: "badge trained", title: `the sequence ending at ${s.leaf}` },
    "trained in ", el("a", { href: `#seq-${index + 1}`, text: `sequence ${index + 1}${s.main ? " (main)" : ""}` }));
}

function nodeView(node, children, grades, sequences = []) {
  const grade = grades[node.id];
  const fork = node.fork
    ? el("span", { class: "badge fork" }, "fork: diverged from ",
      el("a", { href: `#node-${node.fork.diverged_from}`, text: shortId(node.fork.diverged_from) }),
      ` at message ${node.fork.at_message}`)
    : "";
  const place = (index) => (node.kind === "injected" ? "injected" : index < node.n_input_messages ? "input" : "output");
  const item = el("li", { class: `node ${node.kind}`, id: `node-${node.id}`, "data-node": node.id },
    el("div", { class: "card" },
      el("header", {},
        el("a", { class: "mono", href: `#/tokens/${node.id}`, title: "this trajectory's tokens", text: node.id }),
        el("span", { class: `badge ${node.kind}`, text: node.kind }),
        el("span", { class: "badge", text: node.api }),
        node.finish_reason ? el("span", { class: "badge reason", text: node.finish_reason }) : "",
        el("span", { class: "note", text: `+${node.prompt_tokens} prompt, ${node.output_tokens} sampled` }),
        node.policy_versions.length ? el("span", { class: "badge", text: `policy ${node.policy_versions.join(", ")}` }) : "",
        node.meta.routing_disagreements ? el("span", { class: "badge fork", text: `${node.meta.routing_disagreements} routing disagreements` }) : "",
        grade ? el("span", { class: "badge", text: `reward ${number(grade.reward, 3)}, advantage ${number(grade.advantage, 3)}` }) : "",
        branchBadge(node.branch),
        trainedIn(node, sequences),
        fork,
        el("span", { class: "note", text: when(node.created_at) })),
      node.messages.map((message, index) => messageView(message, place(index)))));
  if (children.length) item.append(el("ul", {}, children));
  return item;
}

async function showSession(sessionId) {
  const body = await api(`/v1/admin/sessions/${encodeURIComponent(sessionId)}`);
  const { session, summary } = body;
  crumbs(el("a", { href: "#/", text: "sessions" }), el("span", { class: "mono", text: sessionId }));
  const kids = new Map();
  for (const node of body.nodes) {
    const key = node.parent_id || "";
    if (!kids.has(key)) kids.set(key, []);
    kids.get(key).push(node);
  }
  const sequences = body.sequences || [];
  const build = (parent) => (kids.get(parent) || []).map((node) => nodeView(node, build(node.id), body.grades, sequences));
  const sequenceRows = sequences.map((s, index) => el("tr", { id: `seq-${index + 1}` },
    el("td", { text: `${index + 1}${s.main ? " (main)" : ""}` }),
    el("td", {}, el("a", { class: "mono", href: `#/tokens/${s.leaf}`, text: shortId(s.leaf) })),
    el("td", {}, branchBadge(s.branch) || "continuation"),
    el("td", { text: s.dropped ? "dropped (a retry not gone on from)" : `${s.trained.length} of ${s.response_ids.length} nodes` })));
  const result = session.result;
  view().replaceChildren(
    el("div", { class: "card" },
      el("h1", {}, "Session ", el("span", { class: "mono", text: sessionId }), " ", el("span", { class: `badge ${session.status}`, text: session.status })),
      el("dl", { class: "facts" },
        el("dt", { text: "created" }), el("dd", { text: when(session.created_at) }),
        el("dt", { text: "expires" }), el("dd", { text: when(session.expires_at) }),
        el("dt", { text: "job / step" }), el("dd", { text: `${summary.job_id || "—"} / ${summary.step ?? "—"}` }),
        el("dt", { text: "tree" }), el("dd", { text: `${summary.nodes} nodes: ${summary.turns} generated, ${summary.injected} injected; ${summary.generated_tokens} of ${summary.tokens} tokens sampled` }),
        el("dt", { text: "finish reasons" }), el("dd", { text: summary.finish_reasons.join(", ") || "—" }),
        el("dt", { text: "forks / drift" }), el("dd", { text: `${summary.forks} / ${summary.routing_disagreements} routing disagreements, ${summary.nonfinite_logprobs} non-finite logprobs` }),
        el("dt", { text: "policy" }), el("dd", { text: summary.policy || "base" }),
        el("dt", { text: "policy versions" }), el("dd", { text: summary.policy_versions.join(", ") || "—" }),
        el("dt", { text: "result" }), el("dd", { text: result ? `${result.status}${result.error ? `: ${result.error}` : ""}` : "— (open)" })),
      ...notes(body),
      el("details", {}, el("summary", { text: "context, sample extra, rollout result" }),
        el("pre", { text: JSON.stringify({ context: session.context, extra: session.extra, n_sample: session.n_sample, result }, null, 2) }))),
    el("h2", { text: "Sequences" }),
    el("p", { class: "note", text: `One per generated leaf; every sampled token is trained in exactly one of them (${body.tokens ? `${body.tokens.trained} of ${body.tokens.sampled} sampled tokens trained, ${body.tokens.dropped} dropped` : ""}).` }),
    el("table", { class: "sessions sequences" },
      el("thead", {}, el("tr", {}, ...["sequence", "leaf", "branch", "trains"].map((name) => el("th", { text: name })))),
      el("tbody", {}, ...sequenceRows)),
    el("h2", { text: "Response tree" }),
    el("p", { class: "note", text: "Each node is one model call (generated) or one batch of messages from outside the policy (injected). Its messages are the ones it added: inputs, then its output. Click a node's id for the trajectory ending there." }),
    el("ul", { class: "tree" }, build("")));
}

// -- a trajectory's tokens --------------------------------------------------------------------

function decodeRouting(field) {
  if (!field) return null;
  const bytes = Uint8Array.from(atob(field.data), (char) => char.charCodeAt(0));
  const [rows, layers, topK] = field.shape;
  const data = new DataView(bytes.buffer);
  return { rows, layers, topK, row: (i) => Array.from({ length: layers }, (_, l) =>
    Array.from({ length: topK }, (_, k) => data.getInt16(((i * layers + l) * topK + k) * 2, true))) };
}

function spanAt(spans, index) {
  if (!spans) return null;
  return spans.find((s) => s.start <= index && index < s.end) || null;
}

function tokenColour(mode, t, i) {
  const weight = t.total_loss_weight[i];
  if (mode === "weight") return weight > 0 ? COLOURS.weightOne : COLOURS.weightZero;
  if (weight <= 0) return COLOURS.unsampled;
  if (mode === "logprob") return COLOURS.probability(Math.exp(t.total_token_logprobs[i]));
  return COLOURS.advantage(t.advantages[i], t.advantageScale);
}

function legend(mode) {
  const swatch = (colour, label) => { const s = el("span", { class: "swatch" }); s.style.background = colour; return [s, label]; };
  if (mode === "weight") return el("div", { class: "legend" }, swatch(COLOURS.weightZero, "weight 0 (prompt, tool results, injected)"), swatch(COLOURS.weightOne, "weight 1 (sampled by the policy)"));
  const scale = el("span", { class: "scale" });
  if (mode === "logprob") {
    scale.style.background = `linear-gradient(to right, ${[0, 0.25, 0.5, 0.75, 1].map(COLOURS.probability).join(", ")})`;
    return el("div", { class: "legend" }, "p = exp(logprob): 0", scale, "1", swatch(COLOURS.unsampled, "not sampled"));
  }
  scale.style.background = `linear-gradient(to right, ${COLOURS.advantage(-1, 1)}, ${COLOURS.advantage(0, 1)}, ${COLOURS.advantage(1, 1)})`;
  return el("div", { class: "legend" }, "advantage: −max", scale, "+max", swatch(COLOURS.unsampled, "not sampled"));
}

function tokenDetails(t, i) {
  const piece = t.pieces[i];
  const segment = t.segments.find((s) => s.start <= i && i < s.end);
  const span = spanAt(t.policy_versions, i);
  const facts = [
    ["index", i], ["token id", t.total_token_ids[i]], ["text", piece === null ? `— (${t.pieces_error || "not decoded"})` : JSON.stringify(piece)],
    ["logprob", t.total_loss_weight[i] > 0 ? t.total_token_logprobs[i] : `${t.total_token_logprobs[i]} (not sampled)`],
    ["loss weight", t.total_loss_weight[i]],
    ["policy", span === null ? "—" : span.policy || "base"],
    ["policy version", span === null ? "—" : span.version],
    ["node", segment ? `${segment.node_id} (${segment.kind}, ${segment.part})` : "—"],
  ];
  if (t.advantages) facts.push(["advantage", number(t.advantages[i], 4)]);
  const image = (t.images || []).find((im) => im.start <= i && i < im.start + im.length);
  if (image) facts.push(["image", `${image.sha256}: ${image.width}×${image.height}, ${image.bytes} bytes; tokens ${image.start}–${image.start + image.length - 1}, its placeholder span (weight 0)`]);
  const details = el("div", { class: "card", id: "token-details", "data-index": i },
    el("h2", { text: "Token" }),
    el("dl", { class: "facts" }, facts.flatMap(([name, value]) => [el("dt", { text: name }), el("dd", { class: "mono", "data-fact": name, text: String(value) })])));
  if (!t.routing) details.append(el("p", { class: "note", text: "routed experts: none (a dense model)" }));
  else if (i >= t.routing.rows) details.append(el("p", { class: "note", text: "routed experts: no row for this token" }));
  else {
    const row = t.routing.row(i);
    const observed = row.some((layer) => layer.some((expert) => expert >= 0));
    details.append(el("h2", { text: "Routed experts" }));
    if (!observed) details.append(el("p", { class: "note", text: "-1: no forward pass observed here (nothing to replay)" }));
    details.append(el("table", { class: "experts", id: "experts" },
      el("tr", {}, el("th", { text: "layer" }), Array.from({ length: t.routing.topK }, (_, k) => el("th", { text: `top ${k + 1}` }))),
      row.map((experts, layer) => el("tr", {}, el("th", { text: layer }), experts.map((expert) => el("td", { text: expert }))))));
  }
  return details;
}

async function showTokens(responseId) {
  const body = await api(`/v1/admin/responses/${encodeURIComponent(responseId)}/tokens`);
  const trajectory = body.trajectory;
  const t = { ...trajectory, pieces: body.pieces, pieces_error: body.pieces_error, segments: body.segments, routing: decodeRouting(trajectory.routed_experts) };
  if (body.grade) {
    t.advantages = body.token_advantages || trajectory.total_loss_weight.map(() => body.grade.advantage ?? 0);
    t.advantageScale = Math.max(1e-9, ...t.advantages.map((value, i) => (trajectory.total_loss_weight[i] > 0 ? Math.abs(value) : 0)));
  }
  crumbs(el("a", { href: "#/", text: "sessions" }), el("a", { class: "mono", href: `#/session/${trajectory.session_id}`, text: trajectory.session_id }), el("span", { class: "mono", text: responseId }));
  const sampled = trajectory.total_loss_weight.filter((w) => w > 0).length;
  const meanLogprob = sampled ? trajectory.total_token_logprobs.reduce((sum, lp, i) => sum + (trajectory.total_loss_weight[i] > 0 ? lp : 0), 0) / sampled : null;

  const tokens = el("div", { class: "tokens", id: "tokens" });
  const side = el("div", { class: "side" }, el("div", { class: "card note", id: "token-details", text: "Click a token for its id, text, logprob, weight, policy version and routed experts." }));
  // each image's placeholder span is collapsed into the image, drawn where the span is
  const imageAt = new Map((trajectory.images || []).map((image) => [image.start, image]));
  let skipTo = 0;
  for (const segment of t.segments) {
    const part = el("span", { class: `seg ${segment.part}`, "data-node": segment.node_id, title: `${segment.node_id} · ${segment.kind} · ${segment.part}` });
    for (let i = Math.max(segment.start, skipTo); i < segment.end; i += 1) {
      const image = imageAt.get(i);
      if (image) {
        part.append(el("span", { class: "tok image", "data-i": i, "data-image": image.sha256, "data-length": image.length, title: `image ${image.sha256}: ${image.width}×${image.height}, tokens ${i}–${i + image.length - 1}` },
          imageThumb(trajectory.session_id, image), el("span", { class: "caption", text: `${image.width}×${image.height} · ${image.length} tokens` })));
        skipTo = i + image.length;
        i = skipTo - 1;
        continue;
      }
      const piece = t.pieces[i];
      part.append(el("span", { class: piece === null ? "tok none" : "tok", "data-i": i, "data-weight": t.total_loss_weight[i], text: piece === null ? `⟨${t.total_token_ids[i]}⟩` : piece || "∅" }));
    }
    tokens.append(part);
  }
  tokens.addEventListener("click", (event) => {
    const token = event.target.closest(".tok");
    if (!token) return;
    tokens.querySelectorAll(".tok.picked").forEach((picked) => picked.classList.remove("picked"));
    token.classList.add("picked");
    side.replaceChildren(tokenDetails(t, Number(token.dataset.i)));
  });
  const legendBox = el("div");
  function paint(mode) {
    for (const token of tokens.querySelectorAll(".tok")) token.style.backgroundColor = tokenColour(mode, t, Number(token.dataset.i));
    legendBox.replaceChildren(legend(mode));
  }
  const modes = el("div", { class: "modes", id: "modes" }, "colour by: ",
    [["weight", "loss weight"], ["logprob", "logprob"], ["advantage", "advantage"]].map(([mode, label]) =>
      el("label", {}, el("input", { type: "radio", name: "mode", value: mode, checked: mode === "weight", disabled: mode === "advantage" && !t.advantages, onchange: () => paint(mode) }), ` ${label}`)));
  const messageList = el("div", {}, trajectory.messages.map((message, index) => {
    const node = body.message_nodes[index];
    const shown = messageView(message, "input");
    shown.prepend(el("a", { class: "mono note", href: `#/session/${trajectory.session_id}`, title: "the node this message came from", "data-node": node, text: `${shortId(node)} ` }));
    shown.addEventListener("mouseenter", () => tokens.querySelectorAll(`.seg[data-node="${node}"]`).forEach((s) => s.classList.add("lit")));
    shown.addEventListener("mouseleave", () => tokens.querySelectorAll(".seg.lit").forEach((s) => s.classList.remove("lit")));
    return shown;
  }));
  const grade = body.grade;
  view().replaceChildren(
    el("div", { class: "card" },
      el("h1", {}, "Trajectory ", el("span", { class: "mono", text: responseId })),
      el("dl", { class: "facts" },
        el("dt", { text: "tokens" }), el("dd", { text: `${trajectory.total_token_ids.length} (${sampled} sampled, weight 1) in ${trajectory.turns} turns` }),
        el("dt", { text: "finish reason" }), el("dd", { text: trajectory.finish_reason || "—" }),
        el("dt", { text: "mean logprob" }), el("dd", { text: number(meanLogprob) }),
        el("dt", { text: "reward / advantage" }), el("dd", { id: "grade", text: grade ? `${number(grade.reward)} / ${grade.advantage_kind === "tok" ? "per token" : number(grade.advantage)} (${grade.advantage_kind}, group ${grade.group_id}, step ${grade.step})` : "not graded" }),
        el("dt", { text: "forks" }), el("dd", { text: trajectory.forks.length ? trajectory.forks.map((f) => `${shortId(f.response_id)} diverged from ${shortId(f.diverged_from)} at message ${f.at_message}`).join("; ") : "none" }),
        el("dt", { text: "routing" }), el("dd", { text: t.routing ? `${t.routing.rows} rows × ${t.routing.layers} layers × top ${t.routing.topK}; ${trajectory.routing_disagreements} disagreements` : "dense (none)" })),
      ...notes(body),
      body.pieces_error ? el("p", { class: "note warn", text: `Token text unavailable: ${body.pieces_error}. Ids are shown instead.` }) : "",
      el("details", {}, el("summary", { text: `messages (${trajectory.messages.length}), with the node each came from` }), messageList)),
    modes, legendBox,
    el("div", { class: "tokens-page" }, tokens, side));
  paint("weight");
}

// -- routing ----------------------------------------------------------------------------------

function failed(error) {
  if (error instanceof ApiError && error.status === 401) {
    sessionStorage.removeItem(KEY_STORE);
    adminKey = "";
    askForKey(`The proxy refused the key: ${error.message}`);
    return;
  }
  view().append(el("p", { class: "card note bad", id: "failure", text: error instanceof ApiError ? `${error.status}: ${error.message}` : String(error) }));
}

async function route() {
  takeKeyFromAddress();
  if (!adminKey) return askForKey();
  document.getElementById("forget").hidden = false;
  const hash = location.hash.replace(/^#/, "") || "/";
  view().replaceChildren(el("p", { class: "note", text: "loading…" }));
  try {
    let match;
    if ((match = /^\/session\/([^/?]+)$/.exec(hash))) await showSession(decodeURIComponent(match[1]));
    else if ((match = /^\/tokens\/([^/?]+)$/.exec(hash))) await showTokens(decodeURIComponent(match[1]));
    else await showSessions(new URLSearchParams(hash.split("?")[1] || ""));
    document.body.dataset.ready = hash; // the view is drawn (tests wait for this)
  } catch (error) {
    failed(error);
  }
}

document.getElementById("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORE);
  adminKey = "";
  askForKey();
});
window.addEventListener("hashchange", route);
route();
