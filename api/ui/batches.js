// The Batches view: the project's batches, newest first, filtered by status and model.

import { get, id } from "./api.js";
import { $, bar, el, show } from "./dom.js";
import * as fmt from "./format.js";
import { ACTIVE, cachedShare, eta, record, tokensPerSecond } from "./rates.js";

const LIMIT = 100;
const models = new Set(); // every model seen, for the filter

export function statusBadge(batch) {
  return el("span", { class: `badge status-${batch.status}`, text: fmt.statusLabel(batch.status) });
}

export function progressKind(batch) {
  if (batch.status === "failed" || batch.status === "expired") return "bad";
  if (batch.status === "cancelled" || batch.status === "cancelling") return "muted";
  if (batch.status === "completed") return "good";
  return "";
}

function row(batch) {
  record(batch);
  const counts = batch.request_counts;
  const description = batch.metadata && batch.metadata.description;
  const status = el("td", {}, statusBadge(batch));
  if (batch.status_details) {
    status.append(el("div", { class: "hint warn", title: batch.status_details, text: "no worker" }));
  }
  return el(
    "tr",
    { "data-batch-id": batch.id },
    el(
      "td",
      {},
      el("a", { class: "mono", href: `#/batches/${id(batch.id)}`, text: batch.id }),
      description ? el("div", { class: "hint", text: description }) : null,
    ),
    el("td", { class: "model", text: batch.model ?? fmt.DASH }),
    status,
    el(
      "td",
      { class: "wide" },
      el(
        "div",
        { class: "progress" },
        bar(batch.progress, `progress of ${batch.id}`, progressKind(batch)),
        el("span", { class: "num", text: fmt.percent(batch.progress) }),
      ),
    ),
    el("td", { class: "num done", text: fmt.count(counts.completed) }),
    el("td", { class: `num failed ${counts.failed ? "bad-text" : ""}`, text: fmt.count(counts.failed) }),
    el("td", { class: "num total", text: fmt.count(counts.total) }),
    el("td", { class: "num", text: fmt.rate(tokensPerSecond(batch)) }),
    el("td", { class: "num", text: fmt.percent(cachedShare(batch)) }),
    el("td", { class: "num", text: fmt.duration(eta(batch)) }),
    el("td", { class: "num", title: fmt.time(batch.created_at), text: fmt.age(batch.created_at) }),
  );
}

function updateModelFilter(served) {
  const before = models.size;
  for (const name of served) models.add(name);
  if (models.size === before) return;
  const select = $("model-filter");
  const chosen = select.value;
  select.replaceChildren(
    el("option", { value: "", text: "All" }),
    ...[...models].sort().map((name) => el("option", { value: name, text: name })),
  );
  select.value = chosen;
}

// fetches the list; returns what puts it on the page (called only if it is still wanted)
export async function refreshBatches() {
  const status = $("status-filter").value;
  const model = $("model-filter").value;
  const statuses = status === "active" ? ACTIVE : status ? [status] : [];
  const [list, served] = await Promise.all([
    get("v1/batches", { limit: LIMIT, status: statuses, model }),
    get("v1/models"),
  ]);
  return () => {
    updateModelFilter([
      ...served.data.map((m) => m.id),
      ...list.data.map((b) => b.model).filter((m) => m),
    ]);
    $("batches-body").replaceChildren(...list.data.map(row));
    const filtered = Boolean(status || model);
    $("batches-empty").textContent = filtered ? "No batch matches the filters." : "No batches yet.";
    show($("batches-empty"), list.data.length === 0);
    show($("batches-more"), list.has_more);
  };
}

export function clearBatches() {
  $("batches-body").replaceChildren();
  models.clear();
  $("model-filter").replaceChildren(el("option", { value: "", text: "All" }));
  show($("batches-empty"), false);
  show($("batches-more"), false);
}
