// Hand-drawn SVG charts for the wrenmq dashboard: time series (line + area, with axes and
// a hover readout) and sparklines. No library: the page must work on machines without
// internet, and these few shapes do not need one.
(function () {
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG_NS, name);
  for (const k in attrs) el.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(el);
  return el;
}

// Round numbers for an axis: about `count` ticks from 0 to at least `max` (with `binary`,
// round in KiB, MiB, ...: byte axes read 256 KiB, not 262,144).
function niceTicks(max, count, binary) {
  if (!(max > 0)) max = 1;
  if (binary && max >= 1024) {
    const unit = Math.pow(1024, Math.floor(Math.log(max) / Math.log(1024)));
    return niceTicks(max / unit, count, false).map((v) => v * unit);
  }
  const raw = max / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  const step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 2.5 ? 2.5 : norm <= 5 ? 5 : 10) * mag;
  const ticks = [];
  for (let v = 0; v <= max + step * 0.001; v += step) ticks.push(v);
  if (ticks[ticks.length - 1] < max) ticks.push(ticks[ticks.length - 1] + step);
  return ticks;
}

function clockLabel(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 5) + (d.getSeconds() ? ":" + String(d.getSeconds()).padStart(2, "0") : "");
}

// A time series chart in `svg`. series: [{name, cls, values: [[t, v], ...]}].
// format(v) labels the y axis and the readout.
class TimeChart {
  constructor(svg, opts) {
    this.svg = svg;
    this.opts = Object.assign({height: 220, format: (v) => String(v), span: 300}, opts || {});
    this.series = [];
    this.hoverT = null;
    svg.addEventListener("mousemove", (e) => this.hover(e));
    svg.addEventListener("mouseleave", () => { this.hoverT = null; this.draw(); });
    new ResizeObserver(() => this.draw()).observe(svg);
  }

  set(series) {
    this.series = series;
    this.draw();
  }

  geometry() {
    const w = Math.max(this.svg.clientWidth || 600, 200);
    const h = this.opts.height;
    return {w, h, left: 56, right: 12, top: 12, bottom: 26};
  }

  draw() {
    const svg = this.svg;
    const g = this.geometry();
    svg.setAttribute("viewBox", `0 0 ${g.w} ${g.h}`);
    svg.setAttribute("height", g.h);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const defs = svgEl("defs", {}, svg);
    let tMax = 0, vMax = 0;
    for (const s of this.series) {
      for (const [t, v] of s.values) { if (t > tMax) tMax = t; if (v > vMax) vMax = v; }
    }
    if (!tMax) tMax = Date.now() / 1000;
    // The window: the history there is (at least a minute), up to `span` seconds.
    let tFirst = tMax;
    for (const s of this.series) if (s.values.length && s.values[0][0] < tFirst) tFirst = s.values[0][0];
    const span = Math.min(this.opts.span, Math.max(60, tMax - tFirst));
    const tMin = tMax - span;
    const ticks = niceTicks(vMax, 4, this.opts.binary);
    const top = ticks[ticks.length - 1];
    const pw = g.w - g.left - g.right, ph = g.h - g.top - g.bottom;
    const x = (t) => g.left + ((t - tMin) / (tMax - tMin)) * pw;
    const y = (v) => g.top + ph - (v / top) * ph;
    this.scale = {x, y, tMin, tMax, g};
    const grid = svgEl("g", {class: "grid"}, svg);
    for (const v of ticks) {
      svgEl("line", {x1: g.left, x2: g.w - g.right, y1: y(v), y2: y(v)}, grid);
      const label = svgEl("text", {x: g.left - 8, y: y(v) + 4, "text-anchor": "end", class: "axis"}, grid);
      label.textContent = this.opts.format(v);
    }
    const step = [10, 15, 30, 60, 120, 300].find((st) => span / st <= 6) || 600;
    for (let t = Math.ceil(tMin / step) * step; t <= tMax; t += step) {
      const label = svgEl("text", {x: x(t), y: g.h - 6, "text-anchor": "middle", class: "axis"}, grid);
      label.textContent = clockLabel(t);
    }
    this.series.forEach((s, i) => {
      const pts = s.values.filter(([t]) => t >= tMin - 2);
      if (!pts.length) return;
      const id = `grad-${svg.id}-${i}`;
      const grad = svgEl("linearGradient", {id, x1: 0, x2: 0, y1: 0, y2: 1}, defs);
      svgEl("stop", {offset: "0%", class: `stop-top ${s.cls}`}, grad);
      svgEl("stop", {offset: "100%", class: `stop-bottom ${s.cls}`}, grad);
      let d = "";
      pts.forEach(([t, v], j) => { d += (j ? "L" : "M") + x(Math.max(t, tMin)).toFixed(1) + "," + y(v).toFixed(1); });
      const base = y(0).toFixed(1);
      const first = x(Math.max(pts[0][0], tMin)).toFixed(1), last = x(pts[pts.length - 1][0]).toFixed(1);
      svgEl("path", {d: `${d}L${last},${base}L${first},${base}Z`, class: `area ${s.cls}`, fill: `url(#${id})`}, svg);
      svgEl("path", {d, class: `line ${s.cls}`, "data-series": s.name}, svg);
      const [lt, lv] = pts[pts.length - 1];
      svgEl("circle", {cx: x(lt), cy: y(lv), r: 3, class: `end ${s.cls}`}, svg);
    });
    if (this.hoverT !== null) this.drawHover();
  }

  hover(e) {
    const rect = this.svg.getBoundingClientRect();
    const g = this.geometry();
    const px = (e.clientX - rect.left) * (g.w / rect.width);
    if (!this.scale || px < g.left) { this.hoverT = null; this.draw(); return; }
    const {tMin, tMax} = this.scale;
    this.hoverT = tMin + ((px - g.left) / (g.w - g.left - g.right)) * (tMax - tMin);
    this.draw();
  }

  drawHover() {
    const {x, y, g} = this.scale;
    const t = this.hoverT;
    const layer = svgEl("g", {class: "hover"}, this.svg);
    svgEl("line", {x1: x(t), x2: x(t), y1: g.top, y2: g.h - g.bottom}, layer);
    const rows = [];
    for (const s of this.series) {
      let best = null;
      for (const p of s.values) if (best === null || Math.abs(p[0] - t) < Math.abs(best[0] - t)) best = p;
      if (best) {
        rows.push([s, best]);
        svgEl("circle", {cx: x(best[0]), cy: y(best[1]), r: 4, class: `end ${s.cls}`}, layer);
      }
    }
    if (!rows.length) return;
    const bw = 150, bh = 22 + rows.length * 16;
    let bx = x(t) + 10;
    if (bx + bw > g.w - g.right) bx = x(t) - bw - 10;
    svgEl("rect", {x: bx, y: g.top + 4, width: bw, height: bh, rx: 6, class: "tip"}, layer);
    const head = svgEl("text", {x: bx + 10, y: g.top + 20, class: "tip-head"}, layer);
    head.textContent = clockLabel(rows[0][1][0]);
    rows.forEach(([s, p], i) => {
      const tx = svgEl("text", {x: bx + 10, y: g.top + 38 + i * 16, class: `tip-row ${s.cls}`}, layer);
      tx.textContent = `${s.name}: ${this.opts.format(p[1])}`;
    });
  }
}

// A sparkline (no axes) of values in `svg`.
function sparkline(svg, values, cls) {
  const w = 120, h = 32;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("preserveAspectRatio", "none");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  if (values.length < 2) return;
  const max = Math.max(...values, 1e-9);
  const n = values.length;
  let d = "";
  values.forEach((v, i) => {
    d += (i ? "L" : "M") + ((i / (n - 1)) * w).toFixed(1) + "," + (h - 2 - (v / max) * (h - 4)).toFixed(1);
  });
  svgEl("path", {d: `${d}L${w},${h}L0,${h}Z`, class: `spark-area ${cls || ""}`}, svg);
  svgEl("path", {d, class: `spark-line ${cls || ""}`}, svg);
}

window.WrenCharts = {TimeChart, sparkline, svgEl};
})();
