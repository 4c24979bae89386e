// The view of one batch: progress, timeline, throughput over time, errors by code, its files,
// its metadata, and cancelling it.

import { ApiError, apiKey, download, fileUrl, get, id, post } from "./api.js";
import { progressKind, statusBadge } from "./batches.js";
import { throughputChart } from "./chart.js";
import { $, banner, bar, el } from "./dom.js";
import * as fmt from "./format.js";
import {
  CANCELLABLE, cachedShare, done, eta, isTerminal, record, tokensPerSecond,
} from "./rates.js";

// the summaries of the batch shown, fetched again only when its counts move
let cache = null;
let cancelling = null; // the batch the confirmation dialog is about

async function summaries(batch, against) {
  if (!cache || cache.id !== batch.id || cache.against !== against) {
    cache = { id: batch.id, against, done: -1, failed: -1, errors: null, throughput: null,
      diff: null };
  }
  const path = `v1/batches/${id(batch.id)}`;
  const jobs = [];
  if (done(batch) !== cache.done) {
    jobs.push(get(`${path}/throughput`).then((series) => (cache.throughput = series)));
  }
  if (batch.request_counts.failed !== cache.failed) {
    jobs.push(get(`${path}/error_groups`, { examples: 3 }).then((groups) => (cache.errors = groups)));
  }
  if (against && done(batch) !== cache.done) {
    jobs.push(get(`${path}/diff`, { against }).then((found) => (cache.diff = found)));
  }
  await Promise.all(jobs);
  cache.done = done(batch);
  cache.failed = batch.request_counts.failed;
}

function card(title, ...content) {
  return el("section", { class: "card" }, el("h2", { text: title }), ...content);
}

function kv(label, value, valueClass = "") {
  return el("div", {}, el("dt", { text: label }), el("dd", { class: valueClass, text: value }));
}

function header(batch) {
  const cancel = CANCELLABLE.has(batch.status)
    ? el("button", { type: "button", class: "danger", id: "cancel-button", text: "Cancel batch",
      onclick: () => askCancel(batch.id) })
    : null;
  return el(
    "div",
    { class: "detail-head" },
    el(
      "div",
      {},
      el("h1", { class: "mono", text: batch.id }),
      el(
        "p",
        { class: "muted" },
        el("span", { class: "model", text: batch.model ?? fmt.DASH }),
        ` · ${batch.endpoint} · window ${batch.completion_window}`,
      ),
    ),
    el("div", { class: "head-actions" }, statusBadge(batch), cancel),
  );
}

function progressCard(batch) {
  const counts = batch.request_counts;
  return el(
    "section",
    { class: "card" },
    el(
      "div",
      { class: "progress big" },
      bar(batch.progress, `progress of ${batch.id}`, progressKind(batch)),
      el("span", { class: "num", text: fmt.percent(batch.progress, 1) }),
    ),
    el(
      "dl",
      { class: "stats" },
      kv("Completed", fmt.count(counts.completed)),
      kv("Reused", fmt.count(counts.reused ?? 0)),
      kv("Failed", fmt.count(counts.failed), counts.failed ? "bad-text" : ""),
      kv("Total", fmt.count(counts.total)),
      kv("Output tok/s", fmt.rate(tokensPerSecond(batch))),
      kv("ETA", fmt.duration(eta(batch))),
      kv("Input tokens", fmt.count(batch.usage.input_tokens)),
      kv("Cached input", fmt.percent(cachedShare(batch), 1)),
      kv("Output tokens", fmt.count(batch.usage.output_tokens)),
    ),
  );
}

function timeline(batch) {
  const steps = [["Created", batch.created_at], ["In progress", batch.in_progress_at]];
  if (batch.cancelling_at) steps.push(["Cancelling", batch.cancelling_at]);
  else steps.push(["Finalizing", batch.finalizing_at]);
  const ends = [["Failed", batch.failed_at], ["Expired", batch.expired_at],
    ["Cancelled", batch.cancelled_at]];
  steps.push(ends.find(([, at]) => at) || ["Completed", batch.completed_at]);
  const current = isTerminal(batch) ? -1 : steps.findLastIndex(([, at]) => at);
  let previous = null;
  const items = steps.map(([label, at], i) => {
    const since = at && previous ? `+${fmt.duration(at - previous)}` : "";
    if (at) previous = at;
    const state = i === current ? "current" : at ? "reached" : "pending";
    return el(
      "li",
      { class: state },
      el("span", { class: "step", text: label }),
      el("span", { class: "when", text: at ? fmt.time(at) : fmt.DASH }),
      el("span", { class: "muted since", text: since }),
    );
  });
  return el("ol", { class: "timeline" }, ...items);
}

function errorGroup(group) {
  const lines = `${fmt.count(group.count)} line${group.count === 1 ? "" : "s"}`;
  return el(
    "div",
    { class: "error-group", "data-code": group.code },
    el(
      "div",
      { class: "error-head" },
      el("span", { class: "badge code", text: group.code }),
      el("span", { class: "muted", text: lines }),
    ),
    el(
      "ul",
      { class: "examples" },
      ...group.examples.map((example) =>
        el(
          "li",
          {},
          el("span", { class: "mono custom-id", text: example.custom_id ?? "(no custom_id)" }),
          el("span", { class: "message", text: example.message ?? "" }),
        ),
      ),
    ),
  );
}

function errors(batch) {
  const parts = [];
  const validation = (batch.errors && batch.errors.data) || [];
  if (validation.length) {
    parts.push(
      el("h3", { text: "The file failed validation" }),
      el(
        "ul",
        { class: "examples" },
        ...validation.map((e) =>
          el(
            "li",
            {},
            el("span", { class: "badge code", text: e.code ?? "error" }),
            el("span", { class: "mono", text: e.line ? `line ${e.line}` : "" }),
            el("span", { class: "message", text: e.message ?? "" }),
          ),
        ),
      ),
    );
  }
  const groups = cache.errors ? cache.errors.data : [];
  parts.push(...groups.map(errorGroup));
  if (cache.errors && !cache.errors.complete) {
    const scanned = fmt.count(cache.errors.scanned);
    parts.push(el("p", { class: "muted", text: `Grouped from the first ${scanned} error lines.` }));
  }
  return parts.length ? parts : [el("p", { class: "empty", text: "No errors." })];
}

function fileLink(fileId, label, name) {
  if (!fileId) return null;
  // a plain link when no key is needed; with a key, fetched with it and saved
  const onclick = (event) => {
    if (!apiKey()) return;
    event.preventDefault();
    download(fileId, name).catch((err) => banner(`Download failed: ${err.message}`));
  };
  return el("a", { class: "button", href: fileUrl(fileId), download: name, onclick, text: label });
}

function files(batch) {
  const links = [
    fileLink(batch.output_file_id, "Download output", `${batch.id}_output.jsonl`),
    fileLink(batch.error_file_id, "Download errors", `${batch.id}_errors.jsonl`),
  ].filter(Boolean);
  return [
    el(
      "dl",
      { class: "kv" },
      kv("Input file", batch.input_file_id, "mono"),
      kv("Output file", batch.output_file_id ?? fmt.DASH, "mono"),
      kv("Error file", batch.error_file_id ?? fmt.DASH, "mono"),
    ),
    links.length
      ? el("div", { class: "actions" }, ...links)
      : el("p", { class: "muted", text: "The output and error files come when the batch ends." }),
  ];
}

const SHOWN_CHANGES = 20;

// what changed since another batch (#/batches/ID/since/OTHER), and the form that asks for it
function comparison(batch) {
  const found = cache.diff;
  const parts = [];
  if (found) {
    parts.push(el("p", { class: "diff-summary", text:
      `${fmt.count(found.same)} the same, ${fmt.count(found.changed.length)} changed, ` +
      `${fmt.count(found.new.length)} new, ${fmt.count(found.gone.length)} gone; ` +
      `${fmt.count(found.score_changes_total)} scores moved (since ${found.against})` }));
    parts.push(el("p", { class: "diff-what-ran", text: whatRan(found.what_ran_changed) }));
    const changed = found.changed.slice(0, SHOWN_CHANGES);
    if (changed.length) {
      parts.push(el("ul", { class: "examples diff-changed" },
        ...changed.map((c) => el("li", {}, el("span", { class: "mono", text: c.custom_id })))));
    }
    for (const s of found.score_changes) {
      parts.push(el("p", { class: "mono", text:
        `${s.custom_id}: ${s.before.toFixed(4)} → ${s.after.toFixed(4)}` }));
    }
  }
  const input = el("input", { id: "compare-input", class: "mono", placeholder: "batch_…",
    "aria-label": "Batch to compare with" });
  const go = () => {
    const other = input.value.trim();
    if (other) location.hash = `#/batches/${id(batch.id)}/since/${id(other)}`;
  };
  input.addEventListener("keydown", (event) => { if (event.key === "Enter") go(); });
  parts.push(el("div", { class: "actions" }, input,
    el("button", { type: "button", id: "compare-button", text: "Compare", onclick: go })));
  return parts;
}

// what ran the two batches, where it differs (model fingerprints, Conveyor, engine, sampling)
function whatRan(changes) {
  if (changes === null) return "What ran them: not recorded for one or both.";
  if (!changes.length) {
    return "What ran them: the same model fingerprint, Conveyor, engine settings and sampling " +
      "defaults.";
  }
  const values = (list) => list.map((v) => JSON.stringify(v)).join(", ") || "(none)";
  return "What ran them differs: " +
    changes.map((c) => `${c.name} ${values(c.before)} → ${values(c.after)}`).join("; ");
}

function metadata(batch) {
  const entries = Object.entries(batch.metadata || {});
  if (!entries.length) return el("p", { class: "empty", text: "None." });
  return el("dl", { class: "kv metadata" }, ...entries.map(([k, v]) => kv(k, v)));
}

function render(batch) {
  const parts = [
    el("a", { class: "back", href: "#/batches", text: "← Batches" }),
    header(batch),
    batch.status_details ? el("p", { class: "notice warn", text: batch.status_details }) : null,
    progressCard(batch),
    el(
      "div",
      { class: "columns" },
      card("Timeline", timeline(batch)),
      card("Throughput", throughputChart(cache.throughput, !isTerminal(batch))),
    ),
    card("Errors", ...errors(batch)),
    el("div", { class: "columns" }, card("Files", ...files(batch)), card("Metadata", metadata(batch))),
    card("Changes since another batch", ...comparison(batch)),
  ];
  // what is being typed into the compare field outlives the refresh
  const typing = $("compare-input");
  const kept = typing ? { value: typing.value, focused: document.activeElement === typing } : null;
  $("detail-view").replaceChildren(...parts.filter(Boolean));
  if (kept) {
    $("compare-input").value = kept.value;
    if (kept.focused) $("compare-input").focus();
  }
}

function renderMissing(batchId) {
  $("detail-view").replaceChildren(
    el("a", { class: "back", href: "#/batches", text: "← Batches" }),
    el("h1", { text: "Batch not found" }),
    el("p", {}, "This project has no batch ", el("span", { class: "mono", text: batchId }), "."),
  );
}

// fetches the batch and what is new in its summaries; returns what puts it on the page
export async function refreshDetail(batchId, against = null) {
  let batch;
  try {
    batch = await get(`v1/batches/${id(batchId)}`);
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 404)) throw err;
    return () => {
      cache = null;
      renderMissing(batchId);
    };
  }
  record(batch);
  await summaries(batch, against);
  return () => render(batch);
}

export function clearDetail() {
  cache = null;
  $("detail-view").replaceChildren();
  if ($("cancel-dialog").open) $("cancel-dialog").close();
}

function askCancel(batchId) {
  cancelling = batchId;
  $("cancel-dialog-id").textContent = batchId;
  $("cancel-dialog").showModal();
}

// the dialog's buttons; `then` runs after a cancel was sent (the page refreshes)
export function setupCancel(then) {
  $("cancel-keep").addEventListener("click", () => $("cancel-dialog").close());
  $("cancel-confirm").addEventListener("click", async () => {
    const batchId = cancelling;
    $("cancel-dialog").close();
    try {
      await post(`v1/batches/${id(batchId)}/cancel`);
    } catch (err) {
      banner(`Cancel failed: ${err.message}`);
    }
    then();
  });
}
