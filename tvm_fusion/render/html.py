"""``inspect --graph FILE.html``: the SVG in a page that zooms (wheel), pans (drag), searches ops,
variants and ONNX node names, and shows the nodes a box absorbed; all inline, so the file opens
with no network."""

from __future__ import annotations

import html


def html_page(heading: str, svg: str) -> str:
    """The page around ``svg`` (``draw.svg`` with ``interactive``), titled ``heading``."""
    return _HTML.replace("$TITLE", html.escape(heading)).replace("$SVG", svg)


_HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>$TITLE</title>
<style>
body { margin: 0; font: 13px DejaVu Sans, Verdana, sans-serif; overflow: hidden; }
#bar { position: fixed; top: 0; left: 0; right: 0; padding: 6px 10px; background: #eee; border-bottom: 1px solid #bbb;
       display: flex; gap: 10px; align-items: center; z-index: 1; }
#bar input { width: 22em; }
#view { position: absolute; top: 36px; left: 0; right: 0; bottom: 0; cursor: grab; }
#view svg { width: 100%; height: 100%; }
#info { position: fixed; right: 10px; bottom: 10px; max-width: 40em; max-height: 40vh; overflow: auto; background: #fff;
        border: 1px solid #999; padding: 6px 10px; white-space: pre; display: none; }
.box.dim { opacity: 0.25; }
.box.match rect { stroke: #d00; stroke-width: 2.5; }
.box.current rect { stroke: #00c; stroke-width: 3.5; }
</style></head><body>
<div id="bar"><input id="search" type="search" placeholder="search ops, variants, ONNX node names (Enter: next)">
<span id="count"></span><button id="fit">fit</button>
<span>wheel: zoom, drag: pan, hover or click a box: the ONNX nodes in it</span></div>
<div id="view">$SVG</div><div id="info"></div>
<script>
const svg = document.querySelector("#view svg"), full = svg.viewBox.baseVal;
const home = [full.x, full.y, full.width, full.height];
let box = home.slice(), matches = [], current = -1;
svg.removeAttribute("width"); svg.removeAttribute("height");
function show() { svg.setAttribute("viewBox", box.join(" ")); }
function point(event) {
  const r = svg.getBoundingClientRect(), s = Math.max(box[2] / r.width, box[3] / r.height);
  return [box[0] + (event.clientX - r.left - (r.width - box[2] / s) / 2) * s,
          box[1] + (event.clientY - r.top - (r.height - box[3] / s) / 2) * s];
}
svg.addEventListener("wheel", e => {
  e.preventDefault();
  const [x, y] = point(e), k = Math.exp(e.deltaY * 0.0015);
  box = [x - (x - box[0]) * k, y - (y - box[1]) * k, box[2] * k, box[3] * k]; show();
}, {passive: false});
let drag = null;
svg.addEventListener("mousedown", e => { drag = point(e); });
window.addEventListener("mouseup", () => { drag = null; });
window.addEventListener("mousemove", e => {
  if (!drag) return;
  const [x, y] = point(e); box[0] -= x - drag[0]; box[1] -= y - drag[1]; show();
});
document.getElementById("fit").onclick = () => { box = home.slice(); show(); };
function focus(g) {
  const b = g.getBBox(), w = Math.max(b.width * 4, 500), h = w * box[3] / box[2];
  box = [b.x + b.width / 2 - w / 2, b.y + b.height / 2 - h / 2, w, h]; show();
}
const boxes = Array.from(document.querySelectorAll(".box")), info = document.getElementById("info");
document.getElementById("search").addEventListener("input", e => {
  const q = e.target.value.trim().toLowerCase();
  matches = q ? boxes.filter(g => g.dataset.search.includes(q)) : [];
  boxes.forEach(g => { g.classList.toggle("match", matches.includes(g)); g.classList.toggle("dim", !!q && !matches.includes(g));
                       g.classList.remove("current"); });
  document.getElementById("count").textContent = q ? matches.length + " match" + (matches.length == 1 ? "" : "es") : "";
  current = -1;
});
document.getElementById("search").addEventListener("keydown", e => {
  if (e.key != "Enter" || !matches.length) return;
  if (current >= 0) matches[current].classList.remove("current");
  current = (current + 1) % matches.length; matches[current].classList.add("current"); focus(matches[current]);
});
if (location.hash.startsWith("#search=")) {  // a link to a search: file:///...html#search=softmax
  const input = document.getElementById("search");
  input.value = decodeURIComponent(location.hash.slice(8));
  input.dispatchEvent(new Event("input"));
  input.dispatchEvent(new KeyboardEvent("keydown", {key: "Enter"}));
}
boxes.forEach(g => g.addEventListener("click", () => {
  info.textContent = g.querySelector("title").textContent; info.style.display = "block";
}));
</script></body></html>
"""
