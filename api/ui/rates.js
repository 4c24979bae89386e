// How fast a batch goes: measured between the page's own polls (the recent rate), or over its
// whole run from the batch's timestamps when the page has not watched it long enough.

import { now } from "./format.js";

const WINDOW = 30; // seconds of polls a recent rate is measured over
const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);
export const ACTIVE = ["validating", "in_progress", "finalizing", "cancelling"];
export const CANCELLABLE = new Set(["validating", "in_progress"]);

const history = new Map(); // batch id -> [{t, done, tokens}], oldest first

export function isTerminal(batch) {
  return TERMINAL.has(batch.status);
}

export function done(batch) {
  return batch.request_counts.completed + batch.request_counts.failed;
}

export function record(batch) {
  const samples = history.get(batch.id) || [];
  const t = now();
  samples.push({ t, done: done(batch), tokens: batch.usage.output_tokens });
  while (samples.length > 2 && t - samples[0].t > WINDOW) samples.shift();
  history.set(batch.id, samples);
}

function recent(batch) {
  const samples = history.get(batch.id);
  if (!samples || samples.length < 2) return null;
  const first = samples[0];
  const last = samples[samples.length - 1];
  const span = last.t - first.t;
  if (span < 1) return null;
  return { requests: (last.done - first.done) / span, tokens: (last.tokens - first.tokens) / span };
}

function runSeconds(batch) {
  const start = batch.in_progress_at || batch.created_at;
  const end =
    batch.finalizing_at || batch.completed_at || batch.failed_at || batch.expired_at ||
    batch.cancelled_at || now();
  return Math.max(end - start, 1);
}

// output tokens per second: recent while it runs, else over the whole run
export function tokensPerSecond(batch) {
  if (!batch.usage.output_tokens) return null; // nothing generated yet, or ever
  if (!isTerminal(batch)) {
    const measured = recent(batch);
    if (measured) return measured.tokens;
  }
  if (!batch.in_progress_at) return null;
  return batch.usage.output_tokens / runSeconds(batch);
}

// seconds until every request has a result: what is left over the recent rate, else the
// API's own estimate (over the whole run so far)
export function eta(batch) {
  if (isTerminal(batch) || batch.status === "cancelling") return null;
  const remaining = batch.request_counts.total - done(batch);
  if (remaining <= 0) return null;
  const measured = recent(batch);
  if (measured && measured.requests > 0) return remaining / measured.requests;
  return batch.eta_seconds ?? null;
}

export function cachedShare(batch) {
  const input = batch.usage.input_tokens;
  return input ? batch.usage.input_tokens_details.cached_tokens / input : null;
}
