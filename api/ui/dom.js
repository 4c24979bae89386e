// Building the page's elements. Text goes in as text (textContent, text nodes), never as
// markup: whatever the ledger holds (custom ids, messages, metadata, model names) stays text.

const SVG = "http://www.w3.org/2000/svg";

function fill(node, props, children) {
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = String(value);
    else if (name === "class") node.setAttribute("class", value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// el("td", {class: "num", text: 3}) or el("div", {}, child, "text", ...)
export function el(tag, props, ...children) {
  return fill(document.createElement(tag), props, children);
}

export function svg(tag, props, ...children) {
  return fill(document.createElementNS(SVG, tag), props, children);
}

export function $(id) {
  return document.getElementById(id);
}

export function show(node, visible) {
  node.hidden = !visible;
}

// A bar filled to `fraction` (0..1): the width goes through the CSSOM, which the page's
// Content-Security-Policy allows (inline style attributes it does not).
export function bar(fraction, label, kind = "") {
  const clamped = Math.max(0, Math.min(1, fraction || 0));
  const fillNode = el("div", { class: `bar-fill ${kind}` });
  fillNode.style.width = `${(clamped * 100).toFixed(1)}%`;
  return el(
    "div",
    {
      class: "bar",
      role: "progressbar",
      "aria-valuemin": 0,
      "aria-valuemax": 100,
      "aria-valuenow": Math.round(clamped * 1000) / 10,
      "aria-label": label,
    },
    fillNode,
  );
}

// The message line under the top bar (null hides it).
export function banner(message) {
  const node = $("banner");
  node.textContent = message || "";
  show(node, Boolean(message));
}
