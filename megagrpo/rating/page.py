"""The rating page: one HTML file, its script and style inline, nothing loaded from elsewhere.

Every prompt, reference and answer is a completion of the policy, or its data: hostile text. The
script puts them on the page with textContent only (never innerHTML), images only as
data:image/ URIs; the server's Content-Security-Policy runs only this page's own script (its
nonce), so even markup that got through could run nothing. The page never sees which source
wrote an answer: the server sends answers as A and B and maps them back when it saves.
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>megagrpo rate</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<style nonce="__NONCE__">
body{font-family:sans-serif;margin:1.5em auto;max-width:80em;padding:0 1em;color:#222}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.6em;margin:.3em 0;font-size:.95em}
.answers{display:flex;gap:1.5em}.answer{flex:1;min-width:0}
button{font-size:1em;padding:.35em .8em;margin:.15em;cursor:pointer}
button[aria-pressed=true]{background:#2a6;color:#fff;border-color:#185}
#images img{max-width:20em;margin:.3em}#status{color:#b00;min-height:1.2em}.legend{color:#666;font-size:.9em}
</style></head><body>
<h1>Rate held-out answers</h1>
<p id="about"></p>
<div id="login"><label>Your name <input id="rater" autocomplete="off" size="24"></label>
<button id="start">Start</button></div>
<p id="status" role="status"></p>
<div id="rating" hidden>
<p id="progress"></p>
<h2>Prompt</h2><pre id="prompt"></pre><div id="images"></div>
<details id="reference-box"><summary>Reference answer</summary><pre id="reference"></pre></details>
<div class="answers">
<div class="answer"><h3>Answer A</h3><pre id="answer-A"></pre><div class="scores" id="scores-A"></div></div>
<div class="answer"><h3>Answer B</h3><pre id="answer-B"></pre><div class="scores" id="scores-B"></div></div>
</div>
<p class="legend" id="legend"></p>
<div id="choices" hidden><button data-choice="A">A is better</button><button data-choice="tie">Tie</button>
<button data-choice="B">B is better</button></div>
<p><button id="previous">&larr; Previous</button><button id="next">Next &rarr;</button>
<button id="first-unrated">First unrated</button></p>
</div>
<div id="done" hidden><p id="done-text"></p><button id="review">Review my ratings</button></div>
<script nonce="__NONCE__">
"use strict";
const CONFIG = __CONFIG__;
const params = new URLSearchParams(location.search);
const token = params.get("token") || "";
const $ = (id) => document.getElementById(id);
let rater = null, items = [], ratings = {}, current = 0, saved = 0;

async function api(path, body) {
  const init = {headers: {"X-Token": token}};
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function say(text) { $("status").textContent = text; }

function rated(item) {
  const r = ratings[item.id];
  return CONFIG.pairwise ? r !== undefined : r !== undefined && r.A !== undefined && r.B !== undefined;
}

function nextUnrated(after) {
  for (let k = 1; k <= items.length; k++) {
    const i = (after + k) % items.length;
    if (!rated(items[i])) return i;
  }
  return -1;
}

async function start(name) {
  let data;
  try { data = await api("/api/items?rater=" + encodeURIComponent(name)); } catch (e) { say(e.message); return; }
  rater = data.rater; items = data.items; ratings = data.ratings;
  params.set("rater", rater);
  history.replaceState(null, "", "?" + params.toString());
  $("login").hidden = true;
  say("");
  show(nextUnrated(-1));
}

function show(index) {
  const done = index < 0 || index >= items.length;
  $("rating").hidden = done;
  $("done").hidden = !done;
  if (done) {
    $("done-text").textContent = "All " + items.length + " items rated, thank you, " + rater +
      ". Every rating is saved as you click it; you can close this page.";
    document.body.dataset.item = "done";
    return;
  }
  current = index;
  const item = items[index];
  document.body.dataset.item = String(item.id);
  $("prompt").textContent = item.prompt;
  $("images").replaceChildren(...item.images.filter((u) => u.startsWith("data:image/")).map((u) => {
    const img = document.createElement("img");
    img.src = u;
    img.alt = "image in the prompt";
    return img;
  }));
  $("reference-box").hidden = item.reference === null;
  $("reference").textContent = item.reference === null ? "" : item.reference;
  $("answer-A").textContent = item.answers.A;
  $("answer-B").textContent = item.answers.B;
  mark();
}

function mark() {
  const item = items[current], r = ratings[item.id];
  $("progress").textContent = "Item " + (current + 1) + " of " + items.length + " \\u00b7 " +
    items.filter(rated).length + " rated \\u00b7 rater " + rater;
  for (const b of document.querySelectorAll("button[data-score]")) {
    const pressed = !CONFIG.pairwise && r !== undefined && r[b.dataset.position] === Number(b.dataset.score);
    b.setAttribute("aria-pressed", String(pressed));
  }
  for (const b of document.querySelectorAll("button[data-choice]")) {
    b.setAttribute("aria-pressed", String(CONFIG.pairwise && r === b.dataset.choice));
  }
}

async function rate(body) {
  const item = items[current];
  try {
    await api("/api/rate", Object.assign({rater: rater, item: item.id}, body));
  } catch (e) {
    say("Not saved: " + e.message);
    return;
  }
  say("");
  if (CONFIG.pairwise) ratings[item.id] = body.choice;
  else ratings[item.id] = Object.assign({}, ratings[item.id], {[body.position]: body.score});
  document.body.dataset.saved = String(++saved);
  if (rated(item)) show(nextUnrated(current)); else mark();
}

function setUp() {
  $("about").textContent = CONFIG.pairwise
    ? "Two answers to the same prompt, in random order: pick the better one, or tie."
    : "Two answers to the same prompt, in random order: score each from 1 (bad) to 5 (excellent).";
  $("legend").textContent = CONFIG.pairwise ? "" :
    "1 bad \\u00b7 2 poor \\u00b7 3 fair \\u00b7 4 good \\u00b7 5 excellent";
  for (const position of ["A", "B"]) {
    $("scores-" + position).hidden = CONFIG.pairwise;
    for (let score = 1; score <= 5; score++) {
      const b = document.createElement("button");
      b.textContent = String(score);
      b.dataset.position = position;
      b.dataset.score = String(score);
      b.addEventListener("click", () => rate({position: position, score: score}));
      $("scores-" + position).append(b);
    }
  }
  $("choices").hidden = !CONFIG.pairwise;
  for (const b of document.querySelectorAll("button[data-choice]")) {
    b.addEventListener("click", () => rate({choice: b.dataset.choice}));
  }
  $("previous").addEventListener("click", () => show(Math.max(0, current - 1)));
  $("next").addEventListener("click", () => show(Math.min(items.length - 1, current + 1)));
  $("first-unrated").addEventListener("click", () => show(nextUnrated(-1)));
  $("review").addEventListener("click", () => show(0));
  $("start").addEventListener("click", () => start($("rater").value.trim()));
  $("rater").addEventListener("keydown", (e) => { if (e.key === "Enter") start($("rater").value.trim()); });
  $("rater").value = params.get("rater") || CONFIG.rater || "";
  document.body.dataset.saved = "0";
  if (params.get("rater")) start(params.get("rater")); else document.body.dataset.item = "login";
}

setUp();
</script></body></html>
"""
