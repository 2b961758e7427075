// meshmq dashboard: plain JavaScript and SVG, no library, nothing fetched from elsewhere.
// Every figure comes from the admin API (/api/v1/...) with the key the operator typed; the
// overview polls /api/v1/overview every second and turns two polls into rates.
"use strict";

const HISTORY = 300;  // points kept: 5 minutes at one poll per second
const MIN_WINDOW = 60;  // the x axis spans at least a minute, at most HISTORY points
const state = {
  key: sessionStorage.getItem("meshmq-key") || "",
  tab: "overview",
  last: null,  // the previous overview, for rates
  history: [],  // {t, inRate, outRate, connections}
};

const $ = (selector) => document.querySelector(selector);

class Unauthorized extends Error {}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${state.key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) throw new Unauthorized("wrong API key");
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  return td;
}

// Fills a table's body from rows, touching only the rows that changed: a row drawn the same as
// the one already in its place stays in the page. The page polls every second, and a row
// replaced between a press and a release on its Kick button would lose the click (and any
// text selected in it).
function fill(table, rows, render) {
  const body = $(`${table} tbody`);
  rows.forEach((row, index) => {
    const tr = document.createElement("tr");
    render(row, tr);
    const current = body.children[index];
    if (current === undefined) body.append(tr);
    else if (!current.isEqualNode(tr)) current.replaceWith(tr);
  });
  while (body.children.length > rows.length) body.lastElementChild.remove();
}

const number = (value) => Math.round(value).toLocaleString("en");
const rate = (value) => (value < 10 ? value.toFixed(1) : number(value));
const bytes = (value) => (value < 1024 ? `${value} B` : value < 1048576
  ? `${(value / 1024).toFixed(1)} KiB` : `${(value / 1048576).toFixed(1)} MiB`);
const since = (seconds) => new Date(seconds * 1000).toLocaleString("en-GB");

// ---------------------------------------------------------------------- charts (SVG)

const SVG = "http://www.w3.org/2000/svg";  // the SVG namespace name, not a download

function svgElement(name, attributes) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  return element;
}

function drawChart(svg, series) {
  const width = 600, height = 200, top = 10, bottom = 20;
  const all = series.flatMap((s) => s.values);
  const max = Math.max(1, ...all) * 1.1;
  const children = [];
  for (let i = 0; i <= 4; i++) {
    const y = top + ((height - top - bottom) * i) / 4;
    children.push(svgElement("line", { x1: 0, x2: width, y1: y, y2: y, class: "grid" }));
  }
  const label = svgElement("text", { x: 4, y: top + 10, class: "axis" });
  label.textContent = rate(max);
  children.push(label);
  const zero = svgElement("text", { x: width - 4, y: height - bottom - 3, class: "axis",
                                     "text-anchor": "end" });
  zero.textContent = "0";
  children.push(zero);
  const points = Math.max(0, ...series.map((s) => s.values.length));
  const window = Math.min(HISTORY, Math.max(MIN_WINDOW, points));
  const ago = svgElement("text", { x: 4, y: height - 4, class: "axis" });
  ago.textContent = `-${Math.round(window / 60)} min`;
  children.push(ago);
  for (const s of series) {
    const values = s.values;
    if (values.length < 2) continue;
    const step = width / (window - 1);
    const start = width - step * (values.length - 1);
    const path = values.map((v, i) => {
      const x = start + step * i;
      const y = height - bottom - ((height - top - bottom) * v) / max;
      return `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
    });
    const line = svgElement("path", { d: path.join(" "), stroke: s.color, id: s.id });
    if (s.dashed) line.setAttribute("stroke-dasharray", "6 4");
    if (s.wide) line.style.strokeWidth = "4";  // (the stylesheet beats an attribute)
    children.push(line);
  }
  svg.replaceChildren(...children);
}

// ---------------------------------------------------------------------- tabs

async function overview() {
  const now = await api("GET", "/api/v1/overview");
  const last = state.last;
  state.last = now;
  $("#conn-value").textContent = number(now.connections);
  $("#sessions-value").textContent = number(now.sessions);
  $("#subs-value").textContent = number(now.subscriptions);
  $("#retained-value").textContent = number(now.retained);
  $("#dropped-value").textContent = number(now.dropped);
  $("#workers-value").textContent = number(now.workers_up);
  if (!last) return;
  const seconds = Math.max(0.001, now.time - last.time);
  const point = {
    inRate: Math.max(0, (now.received - last.received) / seconds),
    outRate: Math.max(0, (now.delivered - last.delivered) / seconds),
    connections: now.connections,
  };
  state.history.push(point);
  if (state.history.length > HISTORY) state.history.shift();
  $("#in-rate").textContent = rate(point.inRate);
  $("#out-rate").textContent = rate(point.outRate);
  const style = getComputedStyle(document.documentElement);
  drawChart($("#rate-chart"), [  // "in" wide below, "out" dashed over it: often the same, and
    // then both stay visible (the blue of "in" between the dashes of "out")
    { id: "line-in", color: style.getPropertyValue("--in"), wide: true,
      values: state.history.map((p) => p.inRate) },
    { id: "line-out", color: style.getPropertyValue("--out"), dashed: true,
      values: state.history.map((p) => p.outRate) },
  ]);
  drawChart($("#conn-chart"), [
    { id: "line-conn", color: style.getPropertyValue("--conn"), values: state.history.map((p) => p.connections) },
  ]);
}

async function clients() {
  const search = encodeURIComponent($("#clients-search").value);
  const page = await api("GET", `/api/v1/clients?limit=100&client_id=${search}`);
  $("#clients-total").textContent = `${page.total} connected`;
  fill("#clients-table", page.data, (c, tr) => {
    tr.dataset.clientId = c.client_id;
    tr.append(cell(c.client_id), cell(c.username), cell(c.peer), cell(c.protocol),
      cell(since(c.connected_at)), cell(c.inflight, "num"), cell(c.queued, "num"),
      cell(c.subscriptions, "num"));
    const button = document.createElement("button");
    button.className = "kick";
    button.textContent = "Kick";
    button.addEventListener("click", () => kick(c.client_id));
    const td = cell("");
    td.append(button);
    tr.append(td);
  });
}

async function kick(clientId) {
  try {
    await api("DELETE", `/api/v1/clients/${encodeURIComponent(clientId)}`);
    $("#status").textContent = `kicked ${clientId}`;
  } catch (error) {
    $("#status").textContent = error.message;
  }
  await clients();
}

async function topics() {
  const page = await api("GET", "/api/v1/topics?limit=1000");
  fill("#topics-table", page.data, (t, tr) => tr.append(cell(t.filter), cell(t.subscribers, "num")));
}

async function match(event) {
  event.preventDefault();
  try {
    const page = await api("POST", "/api/v1/subscriptions/match", { topic: $("#match-topic").value });
    const who = [...new Set(page.data.map((row) => row.client_id))];
    $("#match-result").textContent = who.length ? `reaches ${who.join(", ")}` : "reaches nobody";
  } catch (error) {
    $("#match-result").textContent = error.message;
  }
}

async function retained() {
  const filter = encodeURIComponent($("#retained-filter").value || "#");
  const page = await api("GET", `/api/v1/retained?limit=500&filter=${filter}`);
  $("#retained-total").textContent = `${page.total} retained`;
  fill("#retained-table", page.data, (m, tr) => {
    tr.append(cell(m.topic), cell(m.qos, "num"), cell(m.size, "num"),
      cell(m.encoding === "utf-8" ? m.payload : `(base64) ${m.payload}`));
    const button = document.createElement("button");
    button.className = "delete";
    button.textContent = "Delete";
    button.addEventListener("click", async () => {
      await api("DELETE", `/api/v1/retained?topic=${encodeURIComponent(m.topic)}`);
      await retained();
    });
    const td = cell("");
    td.append(button);
    tr.append(td);
  });
}

async function partitions() {
  const page = await api("GET", "/api/v1/log/partitions?limit=1000");
  fill("#partitions-table", page.data, (p, tr) => {
    tr.dataset.partition = p.partition;
    tr.append(cell(p.partition, "num"), cell(p.leader, "num"), cell(p.earliest_offset, "num"),
      cell(p.high_watermark, "num"), cell(bytes(p.size_bytes), "num"), cell(p.segments, "num"),
      cell(p.lag, "num"));
  });
}

const millis = (seconds) => (seconds === null ? "–" : `${(seconds * 1000).toFixed(2)} ms`);

async function services() {
  const page = await api("GET", "/api/v1/services?limit=1000");
  fill("#services-table", page.data, (s, tr) => {
    tr.dataset.service = s.service;
    const errors = cell(s.errors, "num");
    errors.title = s.error_kinds;  // by kind: timeout=N no-responders=N ...
    tr.append(cell(s.service), cell(s.workers, "num"), cell(number(s.requests), "num"),
      cell(number(s.replies), "num"), cell(number(s.retries), "num"),
      cell(number(s.timeouts), "num"), errors, cell(number(s.late_replies), "num"),
      cell(s.in_flight, "num"), cell(millis(s.latency_mean), "num"),
      cell(millis(s.latency_p50), "num"), cell(millis(s.latency_p99), "num"));
  });
}

async function nodes() {
  const node = await api("GET", "/api/v1/node");
  $("#node-summary").textContent = `meshmq ${node.version}, ${node.status}, up ${number(node.uptime)} s, `
    + `${node.workers.up}/${node.workers.count} workers; listeners: `
    + node.listeners.map((l) => `${l.name} ${l.bind}:${l.port}`).join(", ");
  fill("#workers-table", node.workers.list, (w, tr) => tr.append(
    cell(w.index, "num"), cell(w.pid, "num"), cell(since(w.started)), cell(w.clients, "num"),
    cell(w.sessions, "num"), cell(w.leads.join(" "))));
}

const TABS = { overview, clients, topics, retained, partitions, services, nodes };

async function refresh() {
  try {
    await overview();  // always: the charts need every second
    if (state.tab !== "overview") await TABS[state.tab]();
    $("#status").dataset.error = "";
  } catch (error) {
    if (error instanceof Unauthorized) return showLogin(error.message);
    $("#status").textContent = error.message;
  }
}

function show(tab) {
  state.tab = tab;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.tab === tab);
  }
  for (const section of document.querySelectorAll(".tab")) {
    section.hidden = section.id !== `tab-${tab}`;
  }
  refresh();
}

// ---------------------------------------------------------------------- start

let timer = null;

function showLogin(message) {
  clearInterval(timer);
  $("#app").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
}

async function start() {
  try {
    await api("GET", "/api/v1/overview");
  } catch (error) {
    return showLogin(state.key ? error.message : "");
  }
  $("#login").hidden = true;
  $("#app").hidden = false;
  clearInterval(timer);
  timer = setInterval(refresh, 1000);
  refresh();
}

$("#login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("#key").value;
  sessionStorage.setItem("meshmq-key", state.key);
  start();
});
for (const button of document.querySelectorAll("#tabs button")) {
  button.addEventListener("click", () => show(button.dataset.tab));
}
$("#match-form").addEventListener("submit", match);
$("#clients-search").addEventListener("input", () => clients());
$("#retained-filter").addEventListener("change", () => retained());
start();
