// The wrenmq dashboard: live figures from /api/v1/events (Server-Sent Events, read with
// fetch so the page's credentials go with it), tables from the JSON API under /api/v1/.
"use strict";

const {TimeChart, sparkline} = window.WrenCharts;
const $ = (sel, root) => (root || document).querySelector(sel);
const $$ = (sel, root) => Array.from((root || document).querySelectorAll(sel));
const HISTORY = 300;

const state = {
  me: null,
  samples: [],
  tab: "overview",
  lastConnected: null,
  selectedClient: null,
  selectedTopic: null,
  clientLimit: 100,
};

// --- formatting -------------------------------------------------------------------------

function fmtNum(v, digits) {
  if (v === null || v === undefined || isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100 || Number.isInteger(v)) return Math.round(v).toLocaleString("en-US");
  return v.toFixed(digits === undefined ? 1 : digits);
}
function fmtBytes(v) {
  if (v === null || v === undefined || isNaN(v)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(v >= 100 ? 0 : 1) : Math.round(v)) + " " + units[i];
}
const fmtRate = (v) => fmtNum(v) ;
const fmtByteRate = (v) => fmtBytes(v) + "/s";
function fmtAgo(t) {
  if (!t) return "–";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 60) return Math.floor(s) + "s ago";
  if (s < 3600) return Math.floor(s / 60) + "m ago";
  if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m ago";
  return Math.floor(s / 86400) + "d ago";
}
function fmtDuration(s) {
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${s % 60}s`;
  return `${s}s`;
}
function fmtTime(t) {
  return t ? new Date(t * 1000).toLocaleString() : "–";
}
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) {
    if (k === "class") e.className = attrs[k];
    else if (k === "text") e.textContent = attrs[k];
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), attrs[k]);
    else if (attrs[k] !== null && attrs[k] !== undefined) e.setAttribute(k, attrs[k]);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

// --- the API ------------------------------------------------------------------------------

async function api(path, opts) {
  const r = await fetch(path, Object.assign({cache: "no-store", credentials: "same-origin"}, opts || {}));
  if (r.status === 204) return null;
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
  return body;
}
const enc = encodeURIComponent;

let toastTimer = null;
function toast(text, bad) {
  const t = $("#toast");
  t.textContent = text;
  t.className = "toast" + (bad ? " bad" : "");
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, 3500);
}

// A button that asks to be clicked twice: "Kick" -> "Sure?" -> done.
function confirmButton(label, cls, action) {
  const b = el("button", {class: `btn small ${cls} write`, type: "button", text: label});
  let armed = null;
  b.addEventListener("click", async (e) => {
    e.stopPropagation();
    if (!armed) {
      b.textContent = "Sure?";
      b.classList.add("armed");
      armed = setTimeout(() => { armed = null; b.textContent = label; b.classList.remove("armed"); }, 3000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    b.disabled = true;
    try { await action(); } catch (err) { toast(err.message, true); }
    b.disabled = false;
    b.textContent = label;
    b.classList.remove("armed");
  });
  return b;
}

// --- live figures -----------------------------------------------------------------------------

const charts = {};

function setupCharts() {
  charts.rates = new TimeChart($("#chart-rates"), {height: 240, format: fmtRate});
  charts.connections = new TimeChart($("#chart-connections"), {height: 190, format: (v) => fmtNum(v, 0)});
  charts.bytes = new TimeChart($("#chart-bytes"), {height: 190, format: fmtBytes, binary: true});
  charts.log = new TimeChart($("#chart-log"), {height: 220, format: fmtNum});
}

function series(name, cls, pick) {
  return {name, cls, values: state.samples.map((s) => [s.t, pick(s) || 0])};
}

function redraw() {
  const S = state.samples;
  if (!S.length) return;
  const last = S[S.length - 1];
  const f = last.figures, r = last.rates;
  const kpi = (id, value, sub, values, cls) => {
    $(`#${id} .value`).textContent = value;
    if (sub !== undefined) $(`#${id}-sub`).textContent = sub;
    sparkline($(`#${id} .spark`), values.slice(-90), cls);
  };
  const recent = S.slice(-90);
  kpi("kpi-connected", fmtNum(f.connected), `${fmtNum(f.sessions)} sessions · ${fmtNum(f.subscriptions)} subscriptions`,
      recent.map((s) => s.figures.connected), "conn");
  kpi("kpi-msgs-in", fmtRate(r.msgs_in || 0), `${fmtNum(f.msgs_in)} since start`,
      recent.map((s) => s.rates.msgs_in || 0), "in");
  kpi("kpi-msgs-out", fmtRate(r.msgs_out || 0), `${fmtNum(f.msgs_out)} since start`,
      recent.map((s) => s.rates.msgs_out || 0), "out");
  kpi("kpi-bytes", fmtByteRate((r.bytes_in || 0) + (r.bytes_out || 0)),
      `↓ ${fmtBytes(r.bytes_in || 0)}/s in · ↑ ${fmtBytes(r.bytes_out || 0)}/s out`,
      recent.map((s) => (s.rates.bytes_in || 0) + (s.rates.bytes_out || 0)), "");
  if (f.log_end_offset !== undefined) {
    kpi("kpi-log", fmtNum(f.log_end_offset - f.log_start_offset), `records · ${fmtRate(r.log_records || 0)}/s appended`,
        recent.map((s) => s.rates.log_records || 0), "log");
  } else {
    kpi("kpi-log", "off", "storage in memory", [], "log");
  }
  kpi("kpi-drops", fmtRate(r.dropped || 0), `${fmtNum(f.dropped)} dropped · ${fmtNum(f.refused)} refused`,
      recent.map((s) => s.rates.dropped || 0), "drop");
  $("#tab-count-clients").textContent = f.connected ? fmtNum(f.connected) : "";

  charts.rates.set([series("in", "in", (s) => s.rates.msgs_in), series("out", "out", (s) => s.rates.msgs_out)]);
  charts.connections.set([series("clients", "conn", (s) => s.figures.connected),
                          series("sessions", "sess", (s) => s.figures.sessions)]);
  charts.bytes.set([series("in", "in", (s) => s.rates.bytes_in), series("out", "out", (s) => s.rates.bytes_out)]);
  if (state.tab === "log") {
    charts.log.set([series("records/s", "in", (s) => s.rates.log_records), series("bytes/s", "out", (s) => s.rates.log_bytes)]);
  }
  drawDrops(f);
  if (state.lastConnected !== null && state.lastConnected !== f.connected && state.tab !== "overview") refreshTab();
  state.lastConnected = f.connected;
}

function drawDrops(f) {
  const rows = [
    ["Dropped messages", f.dropped, "drop"],
    ["Refused connections", f.refused, "warn"],
    ["Denied by ACL", f.denied, "warn"],
    ["Expired messages", f.expired, "muted"],
    ["Rate limited", f.rate_limited, "muted"],
  ];
  const max = Math.max(1, ...rows.map((r) => r[1] || 0));
  const box = $("#drops");
  box.textContent = "";
  for (const [label, v, cls] of rows) {
    const fill = el("div", {class: `bar-fill ${cls}`});
    fill.style.width = `${Math.max(v ? 2 : 0, (100 * (v || 0)) / max)}%`;
    box.append(el("div", {class: "bar"}, el("span", {class: "bar-label", text: label}),
                  el("div", {class: "bar-track"}, fill), el("span", {class: "bar-value", text: fmtNum(v || 0)})));
  }
}

function setLive(on, text) {
  $("#live").classList.toggle("on", on);
  $("#live-text").textContent = text || (on ? "live" : "reconnecting");
}

function onEvent(block) {
  let name = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  const payload = JSON.parse(data);
  if (name === "history") state.samples = payload;
  else if (name === "sample") {
    state.samples.push(payload);
    if (state.samples.length > HISTORY) state.samples.splice(0, state.samples.length - HISTORY);
  }
  redraw();
}

async function stream() {
  let wait = 500;
  for (;;) {
    try {
      const r = await fetch("/api/v1/events", {cache: "no-store", headers: {Accept: "text/event-stream"}});
      if (!r.ok) throw new Error(r.status);
      setLive(true);
      wait = 500;
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += decoder.decode(value, {stream: true});
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, i);
          buf = buf.slice(i + 2);
          if (!block.startsWith(":")) onEvent(block);
        }
      }
    } catch (e) { /* reconnect below */ }
    setLive(false);
    await new Promise((res) => setTimeout(res, wait));
    wait = Math.min(wait * 2, 10000);
  }
}

// --- tabs ----------------------------------------------------------------------------------------

function showTab(name) {
  state.tab = name;
  $$("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  $$(".tab-page").forEach((p) => p.classList.toggle("active", p.id === `page-${name}`));
  if (name === "log") redraw();
  refreshTab();
}

let refreshing = false;
async function refreshTab() {
  if (refreshing) return;
  refreshing = true;
  try {
    const loaders = {overview: loadTopClients, clients: loadClients, subscriptions: loadSubs,
                     retained: loadRetained, log: loadLog, cluster: loadNodes, banned: loadBans};
    await loaders[state.tab]();
  } catch (e) {
    toast(e.message, true);
  } finally {
    refreshing = false;
  }
}

// --- clients ---------------------------------------------------------------------------------

function statusDot(on) {
  return el("span", {class: `dot ${on ? "on" : "off"}`, title: on ? "connected" : "offline"});
}

async function loadTopClients() {
  const data = await api("/api/v1/clients?connected=true&limit=1000");
  const rows = data.items.sort((a, b) => (b.bytes_in + b.bytes_out) - (a.bytes_in + a.bytes_out)).slice(0, 8);
  const body = $("#top-clients tbody");
  body.textContent = "";
  for (const c of rows) {
    body.append(el("tr", {"data-client-id": c.client_id, onclick: () => { showTab("clients"); selectClient(c.client_id); }},
      el("td", {}, statusDot(true)), el("td", {class: "mono", text: c.client_id}),
      el("td", {class: "num muted", text: `in ${fmtBytes(c.bytes_in)}`}),
      el("td", {class: "num muted", text: `out ${fmtBytes(c.bytes_out)}`})));
  }
  if (!rows.length) body.append(el("tr", {}, el("td", {class: "muted", text: "No clients connected."})));
}

async function loadClients() {
  const prefix = $("#client-search").value.trim();
  const connected = $("#client-state").value;
  const q = `limit=${state.clientLimit}&prefix=${enc(prefix)}${connected ? `&connected=${connected}` : ""}`;
  const data = await api(`/api/v1/clients?${q}`);
  const body = $("#clients-table tbody");
  body.textContent = "";
  for (const c of data.items) {
    const tr = el("tr", {"data-client-id": c.client_id, class: c.client_id === state.selectedClient ? "selected" : "",
                         onclick: () => selectClient(c.client_id)},
      el("td", {}, statusDot(c.connected)),
      el("td", {class: "mono strong", text: c.client_id}),
      el("td", {text: c.username || "–"}),
      el("td", {class: "mono muted", text: c.address || "–"}),
      el("td", {}, el("span", {class: "tag", text: c.protocol})),
      el("td", {class: "muted", text: c.connected ? fmtAgo(c.connected_at) : "offline"}),
      el("td", {class: "num", text: fmtNum(c.subscriptions)}),
      el("td", {class: "num", text: fmtNum(c.inflight)}),
      el("td", {class: "num", text: fmtNum(c.queued)}),
      el("td", {class: "num muted", text: c.connected ? fmtBytes(c.bytes_in) : "–"}),
      el("td", {class: "num muted", text: c.connected ? fmtBytes(c.bytes_out) : "–"}),
      el("td", {class: "actions"}, c.connected ? confirmButton("Kick", "danger kick", () => kick(c.client_id, false)) : null));
    body.append(tr);
  }
  $("#clients-empty").hidden = data.items.length > 0;
  $("#clients-total").textContent = `${fmtNum(data.total)} match`;
  $("#clients-pager").hidden = !data.next;
  if (state.selectedClient) loadClientDetail(state.selectedClient).catch(() => {});
}

async function kick(cid, session) {
  const r = await api(`/api/v1/clients/${enc(cid)}${session ? "?session=true" : ""}`, {method: "DELETE"});
  toast(session ? `Ended the session of ${cid}` : `Disconnected ${cid}`);
  setTimeout(refreshTab, 300);
  return r;
}

function selectClient(cid) {
  state.selectedClient = cid;
  $$("#clients-table tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.clientId === cid));
  loadClientDetail(cid).catch((e) => toast(e.message, true));
}

async function loadClientDetail(cid) {
  const box = $("#client-detail");
  let c;
  try {
    c = await api(`/api/v1/clients/${enc(cid)}`);
  } catch (e) {
    box.textContent = "";
    box.append(el("div", {class: "muted", text: `${cid}: no session any more.`}));
    return;
  }
  const kv = (k, v) => el("div", {class: "kv"}, el("span", {text: k}), el("span", {class: "mono", text: v}));
  box.textContent = "";
  box.append(
    el("div", {class: "detail-head"}, statusDot(c.connected), el("h3", {class: "mono", text: c.client_id})),
    el("div", {class: "kvs"},
      kv("State", c.connected ? `connected ${fmtAgo(c.connected_at)}` : "offline session"),
      kv("Node", c.node), kv("User", c.username || "–"), kv("Address", c.address || "–"), kv("Listener", c.listener || "–"),
      kv("MQTT", c.protocol), kv("Keepalive", c.keepalive === null ? "–" : `${c.keepalive}s`),
      kv("Session expiry", c.session_expiry_interval === 4294967295 ? "never"
         : c.session_expiry_interval ? fmtDuration(c.session_expiry_interval) + " after it goes" : "ends with the connection"),
      kv("In-flight · queued", `${c.inflight} · ${c.queued} (${fmtBytes(c.queued_bytes)})`),
      kv("Packets in", fmtNum(c.packets_in)), kv("Bytes in · out", `${fmtBytes(c.bytes_in)} · ${fmtBytes(c.bytes_out)}`),
      kv("Dropped", fmtNum(c.dropped)),
      kv("Will", c.will ? `${c.will.topic} (QoS ${c.will.qos}${c.will.retain ? ", retained" : ""})` : "–")),
    el("h4", {text: `Subscriptions (${c.subscriptions.length})`}),
    el("div", {class: "subs"}, ...c.subscriptions.map((s) =>
      el("div", {class: "sub-row"}, el("span", {class: "mono", text: s.filter}), el("span", {class: "tag", text: `QoS ${s.qos}`})))),
    el("div", {class: "detail-actions"},
      c.connected ? confirmButton("Kick", "danger kick", () => kick(c.client_id, false)) : null,
      confirmButton("End session", "ghost end-session", () => kick(c.client_id, true)),
      confirmButton("Ban client id", "ghost", async () => {
        await api("/api/v1/banned", {method: "POST", headers: {"Content-Type": "application/json"},
                                     body: JSON.stringify({kind: "client_id", value: c.client_id})});
        toast(`Banned ${c.client_id}`);
        setTimeout(refreshTab, 300);
      })));
  applyRights();
}

// --- subscriptions, retained --------------------------------------------------------------------

async function loadSubs() {
  const data = await api(`/api/v1/subscriptions?limit=500&filter=${enc($("#sub-search").value.trim())}`);
  const body = $("#subs-table tbody");
  body.textContent = "";
  for (const s of data.items) {
    const opts = [s.no_local ? "no local" : null, s.retain_as_published ? "retain as published" : null,
                  s.subscription_identifier ? `id ${s.subscription_identifier}` : null].filter(Boolean).join(", ");
    body.append(el("tr", {onclick: () => { showTab("clients"); selectClient(s.client_id); }},
      el("td", {class: "mono strong", text: s.filter}), el("td", {class: "mono", text: s.client_id}),
      el("td", {text: s.share || "–"}), el("td", {class: "num", text: s.qos}), el("td", {class: "muted", text: opts || "–"})));
  }
  $("#subs-empty").hidden = data.items.length > 0;
  $("#subs-total").textContent = `${fmtNum(data.total)} subscriptions`;
}

async function loadRetained() {
  const flt = $("#retained-filter").value.trim() || "#";
  const data = await api(`/api/v1/retained?limit=500&filter=${enc(flt)}`);
  const body = $("#retained-table tbody");
  body.textContent = "";
  for (const m of data.items) {
    const preview = m.payload !== undefined ? m.payload.slice(0, 80) : "(binary)";
    body.append(el("tr", {"data-topic": m.topic, class: m.topic === state.selectedTopic ? "selected" : "",
                          onclick: () => selectTopic(m.topic)},
      el("td", {class: "mono strong", text: m.topic}), el("td", {class: "num", text: fmtBytes(m.size)}),
      el("td", {class: "num", text: m.qos}), el("td", {class: "muted", text: fmtAgo(m.timestamp)}),
      el("td", {class: "mono muted ellipsis", text: preview}),
      el("td", {class: "actions"}, confirmButton("Clear", "danger", () => clearRetained(m.topic)))));
  }
  $("#retained-empty").hidden = data.items.length > 0;
  $("#retained-total").textContent = `${fmtNum(data.total)} retained`;
  applyRights();
}

async function clearRetained(topic) {
  await api(`/api/v1/retained/${topic.split("/").map(enc).join("/")}`, {method: "DELETE"});
  toast(`Cleared ${topic}`);
  if (state.selectedTopic === topic) { state.selectedTopic = null; $("#retained-detail").textContent = ""; }
  loadRetained();
}

async function selectTopic(topic) {
  state.selectedTopic = topic;
  $$("#retained-table tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.topic === topic));
  const m = await api(`/api/v1/retained/${topic.split("/").map(enc).join("/")}`);
  const box = $("#retained-detail");
  let text = m.payload !== undefined ? m.payload : null;
  if (text !== null) { try { text = JSON.stringify(JSON.parse(text), null, 2); } catch (e) { /* not JSON */ } }
  box.textContent = "";
  box.append(el("h3", {class: "mono", text: m.topic}),
    el("div", {class: "kvs"},
      el("div", {class: "kv"}, el("span", {text: "Size"}), el("span", {text: fmtBytes(m.size)})),
      el("div", {class: "kv"}, el("span", {text: "QoS"}), el("span", {text: m.qos})),
      el("div", {class: "kv"}, el("span", {text: "Set"}), el("span", {text: fmtTime(m.timestamp)})),
      el("div", {class: "kv"}, el("span", {text: "By"}), el("span", {class: "mono", text: m.client_id || "the broker"}))),
    el("pre", {class: "payload", text: text !== null ? text : `base64: ${m.payload_base64}`}));
}

// --- log, cluster, bans ---------------------------------------------------------------------------

async function loadLog() {
  const data = await api("/api/v1/log");
  const box = $("#partitions");
  box.textContent = "";
  if (!data.enabled) {
    box.append(el("div", {class: "panel muted", text: "The commit log is off ([storage] mode = \"memory\" or [log] enabled = false)."}));
    return;
  }
  for (const p of data.partitions) {
    const stat = (k, v) => el("div", {class: "stat"}, el("div", {class: "label", text: k}), el("div", {class: "value", text: v}));
    box.append(el("div", {class: "panel card"},
      el("div", {class: "panel-head"}, el("h2", {text: `Partition ${p.partition}`}), el("span", {class: "tag", text: `node ${p.node}`})),
      el("div", {class: "stats"},
        stat("Records", fmtNum(p.records)), stat("Size", fmtBytes(p.bytes)), stat("Segments", fmtNum(p.segments)),
        stat("Offsets", `${fmtNum(p.start_offset)} → ${fmtNum(p.end_offset)}`),
        stat("Oldest", fmtTime(p.first_timestamp)), stat("Newest", fmtTime(p.last_timestamp)),
        stat("Unwritten", fmtBytes(p.unwritten_bytes)), stat("Lost to retention", fmtNum(p.lost_to_retention)),
        stat("Disk free", p.disk_free_bytes === null ? "–" : fmtBytes(p.disk_free_bytes))),
      el("div", {class: "muted small", text: `Retention: ${data.retention.hours ? data.retention.hours + " h" : "no time limit"}, ` +
        `${data.retention.bytes ? fmtBytes(data.retention.bytes) : "no size limit"} · topics ${data.topics.join(", ")}`})));
  }
}

async function loadNodes() {
  const data = await api("/api/v1/nodes");
  const box = $("#nodes");
  box.textContent = "";
  if (!data.cluster) box.append(el("div", {class: "panel muted", text: "A single node: no [cluster] configured."}));
  if (data.unreachable) toast(`Not answering: ${Object.keys(data.unreachable).join(", ")}`, true);
  for (const n of data.nodes) {
    box.append(el("div", {class: `panel card node ${n.up ? "up" : "down"}`},
      el("div", {class: "panel-head"}, el("div", {class: "detail-head"}, statusDot(n.up), el("h2", {text: n.name})),
         el("span", {class: "tag", text: n.self ? "this node" : n.up ? "link up" : "link down"})),
      el("div", {class: "stats"},
        el("div", {class: "stat"}, el("div", {class: "label", text: "Clients"}), el("div", {class: "value", text: fmtNum(n.connected)})),
        el("div", {class: "stat"}, el("div", {class: "label", text: "Msgs in / s"}), el("div", {class: "value", text: n.rates ? fmtRate(n.rates.msgs_in || 0) : "–"})),
        el("div", {class: "stat"}, el("div", {class: "label", text: "Msgs out / s"}), el("div", {class: "value", text: n.rates ? fmtRate(n.rates.msgs_out || 0) : "–"}))),
      el("div", {class: "kvs"},
        el("div", {class: "kv"}, el("span", {text: "Link"}), el("span", {class: "mono", text: n.link || "–"})),
        el("div", {class: "kv"}, el("span", {text: "Admin"}), el("span", {class: "mono", text: n.admin || "–"})))));
  }
}

async function loadBans() {
  const data = await api("/api/v1/banned");
  const body = $("#bans-table tbody");
  body.textContent = "";
  for (const b of data.items) {
    body.append(el("tr", {},
      el("td", {}, el("span", {class: "tag", text: b.kind})), el("td", {class: "mono strong", text: b.value}),
      el("td", {text: b.until ? fmtTime(b.until) : "for good"}), el("td", {class: "muted", text: b.reason || "–"}),
      el("td", {class: "muted", text: fmtAgo(b.created)}),
      el("td", {class: "actions"}, confirmButton("Lift", "ghost", async () => {
        await api(`/api/v1/banned/${enc(b.kind)}/${b.value.split("/").map(enc).join("/")}`, {method: "DELETE"});
        toast(`Lifted the ban of ${b.value}`);
        loadBans();
      }))));
  }
  $("#bans-empty").hidden = data.items.length > 0;
  applyRights();
}

// --- who, header, forms -------------------------------------------------------------------------

function applyRights() {
  const write = state.me && state.me.write;
  document.body.classList.toggle("read-only", !write);
}

async function loadHeader() {
  const me = await api("/api/v1/whoami");
  state.me = me;
  $("#node-name").textContent = me.node;
  $("#version").textContent = `v${me.version}`;
  $("#who").textContent = me.write ? me.name : `${me.name} · read-only`;
  document.title = `wrenmq · ${me.node}`;
  applyRights();
  const stats = await api("/api/v1/stats");
  state.started = stats.started;
}

function tickUptime() {
  if (state.started) $("#uptime").textContent = `up ${fmtDuration(Date.now() / 1000 - state.started)}`;
}

function setupForms() {
  $$("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $$("[data-goto]").forEach((a) => a.addEventListener("click", () => showTab(a.dataset.goto)));
  let typing = null;
  const later = (fn) => () => { clearTimeout(typing); typing = setTimeout(fn, 250); };
  $("#client-search").addEventListener("input", later(loadClients));
  $("#client-state").addEventListener("change", loadClients);
  $("#clients-more").addEventListener("click", () => { state.clientLimit += 100; loadClients(); });
  $("#sub-search").addEventListener("input", later(loadSubs));
  $("#retained-filter").addEventListener("input", later(loadRetained));
  $("#ban-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const duration = $("#ban-duration").value;
    const body = {kind: $("#ban-kind").value, value: $("#ban-value").value.trim(), reason: $("#ban-reason").value};
    if (duration) body.duration = Number(duration);
    try {
      const r = await api("/api/v1/banned", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
      toast(`Banned ${r.value}${r.disconnected.length ? ` (${r.disconnected.length} disconnected)` : ""}`);
      $("#ban-value").value = "";
      loadBans();
    } catch (err) { toast(err.message, true); }
  });
  $("#open-publish").addEventListener("click", () => { $("#publish-modal").hidden = false; $("#pub-topic").focus(); });
  $("#publish-close").addEventListener("click", () => { $("#publish-modal").hidden = true; });
  $("#publish-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const body = {topic: $("#pub-topic").value.trim(), payload: $("#pub-payload").value,
                  qos: Number($("#pub-qos").value), retain: $("#pub-retain").checked};
    try {
      const r = await api("/api/v1/publish", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
      $("#pub-result").textContent = r.matched ? "Published: subscribers matched." : "Published: no subscriber matched.";
    } catch (err) { $("#pub-result").textContent = err.message; }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  setupCharts();
  setupForms();
  loadHeader().catch((e) => toast(e.message, true));
  stream();
  refreshTab();
  // Tables every 3 s while shown; the overview's busiest clients (a walk of every session on
  // the broker) every 10 s. Nothing while the page is hidden.
  let ticks = 0;
  setInterval(() => {
    ticks++;
    if (!document.hidden && ticks % (state.tab === "overview" ? 10 : 3) === 0) refreshTab();
  }, 1000);
  setInterval(tickUptime, 1000);
});
