// The page: which view the address names, polling it every two seconds, and the API key.

import { AuthError, apiKey, setApiKey } from "./api.js";
import { clearBatches, refreshBatches } from "./batches.js";
import { clearDetail, refreshDetail, setupCancel } from "./detail.js";
import { $, banner, show } from "./dom.js";
import { clock, now } from "./format.js";
import { clearWorkers, refreshWorkers } from "./workers.js";

const POLL_MS = 2000;
const VIEWS = ["login-view", "batches-view", "detail-view", "workers-view"];

let timer = null;
let generation = 0; // a refresh started before the latest one must not touch the page
let offline = false;

function decoded(text) {
  try {
    return decodeURIComponent(text);
  } catch {
    return text; // a hand-typed address with a stray %
  }
}

function route() {
  const [page, ...rest] = location.hash.replace(/^#\/?/, "").split("/");
  if (page === "workers") {
    return { view: "workers-view", nav: "nav-workers", refresh: refreshWorkers };
  }
  if (page === "batches" && rest.length && rest[0]) {
    // #/batches/ID, or #/batches/ID/since/OTHER: what changed since the batch OTHER
    const since = rest.length > 2 && rest[1] === "since";
    const batchId = decoded(since ? rest[0] : rest.join("/"));
    const against = since ? decoded(rest.slice(2).join("/")) : null;
    return {
      view: "detail-view", nav: "nav-batches", refresh: () => refreshDetail(batchId, against),
    };
  }
  return { view: "batches-view", nav: "nav-batches", refresh: refreshBatches };
}

function showOnly(view) {
  for (const name of VIEWS) show($(name), name === view);
}

function signedOut(message) {
  generation += 1; // what is still on its way from the API is dropped
  clearTimeout(timer);
  setApiKey(null);
  clearBatches();
  clearDetail();
  clearWorkers();
  showOnly("login-view");
  show($("sign-out"), false);
  $("updated").textContent = "";
  $("login-error").textContent = message;
  show($("login-error"), Boolean(message));
  $("key-input").focus();
}

async function tick() {
  clearTimeout(timer);
  if (document.hidden) return; // polling resumes when the tab is shown again
  const mine = ++generation;
  const current = route();
  for (const nav of ["nav-batches", "nav-workers"]) {
    $(nav).classList.toggle("active", nav === current.nav);
  }
  try {
    const paint = await current.refresh();
    if (mine !== generation) return; // the page moved on (another view, key or poll)
    paint();
    showOnly(current.view);
    show($("sign-out"), Boolean(apiKey()));
    $("updated").textContent = `Updated ${clock(now())}`;
    if (offline) banner(null);
    offline = false;
  } catch (err) {
    if (mine !== generation) return;
    if (err instanceof AuthError) {
      // no key, or one the API refused: nothing of any project stays on the page
      signedOut(apiKey() ? "That key was not accepted." : "");
      return; // no polling until a key is given
    }
    offline = true;
    banner(`Cannot read from the API: ${err.message}`);
  }
  timer = setTimeout(tick, POLL_MS);
}

function start() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    $("key-input").value = "";
    setApiKey(key);
    tick();
  });
  $("sign-out").addEventListener("click", () => {
    signedOut("");
    tick(); // with authentication off, the page needs no key
  });
  $("status-filter").addEventListener("change", tick);
  $("model-filter").addEventListener("change", tick);
  window.addEventListener("hashchange", tick);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) tick();
  });
  setupCancel(tick);
  tick();
}

start();
