// Markdown to DOM nodes, for the model's answers. Every piece of text becomes a text node and every
// element is made with createElement: nothing the model writes is ever parsed as HTML, so a reply
// holding <script> or <img onerror=...> shows those characters and runs nothing.
//
// Covered: headings, paragraphs, emphasis (*, _, **, __, ~~), inline code, links, lists (nested,
// ordered or not), block quotes, tables, horizontal rules and fenced code (with a copy button).
// An unclosed code fence (an answer still streaming) renders as code up to the end.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+/;
const TABLE_DELIMITER = /^(?=.*\|)\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/; // with at least one |
const SAFE_URL = /^(https?:|mailto:)/i;

function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  for (const child of children) node.append(child);
  return node;
}

// The whole text as a DocumentFragment.
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) body.push(lines[i]);
      i++; // the closing fence
      parent.append(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      parent.append(el(`h${m[1].length}`, null, ...inline(m[2])));
      i++;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
      const quote = el("blockquote");
      renderBlocks(body, quote);
      parent.append(quote);
    } else if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, parent);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_DELIMITER.test(lines[i + 1])) {
      i = renderTable(lines, i, parent);
    } else {
      const body = [line.trim()];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++) body.push(lines[i].trim());
      const p = el("p");
      body.forEach((text, k) => {
        if (k) p.append(el("br"));
        p.append(...inline(text));
      });
      parent.append(p);
    }
  }
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
    || LIST_ITEM.test(line)
    || (line.includes("|") && i + 1 < lines.length && TABLE_DELIMITER.test(lines[i + 1]));
}

// One list from lines[start]: items at its indent; deeper lines belong to the item above them (a nested list,
// a second paragraph). Returns the index of the first line after the list.
function renderList(lines, start, parent) {
  const first = LIST_ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  let i = start;
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [lines[i].slice(m[0].length)];
    const contentIndent = m[0].length;
    for (i++; i < lines.length; i++) {
      const line = lines[i];
      const deeper = line.length - line.trimStart().length > indent;
      if (!line.trim()) {
        // a blank line ends the list unless the next line still belongs to this item
        const next = lines[i + 1];
        if (next === undefined || next.length - next.trimStart().length <= indent) break;
        body.push("");
      } else if (deeper) {
        body.push(line.slice(Math.min(contentIndent, line.length - line.trimStart().length)));
      } else if (!startsBlock(lines, i) && body[body.length - 1] !== "") {
        body.push(line.trim()); // a lazy continuation of the item's paragraph
      } else {
        break;
      }
    }
    const item = el("li");
    const blocks = document.createDocumentFragment();
    renderBlocks(body, blocks);
    // a one-paragraph item shows its text without the paragraph's margins
    if (blocks.childNodes.length === 1 && blocks.firstChild.tagName === "P") {
      item.append(...blocks.firstChild.childNodes);
    } else {
      item.append(blocks);
    }
    list.append(item);
    while (i < lines.length && !lines[i].trim() && LIST_ITEM.test(lines[i + 1] || "")
           && LIST_ITEM.exec(lines[i + 1])[1].length === indent) i++;
  }
  parent.append(list);
  return i;
}

function cells(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function renderTable(lines, start, parent) {
  const header = cells(lines[start]);
  const align = cells(lines[start + 1]).map((d) =>
    d.startsWith(":") && d.endsWith(":") ? "center" : d.endsWith(":") ? "right" : d.startsWith(":") ? "left" : "");
  const row = (values, tag) => el("tr", null, ...header.map((_, k) => {
    const cell = el(tag, null, ...inline(values[k] ?? ""));
    if (align[k]) cell.style.textAlign = align[k];
    return cell;
  }));
  const body = el("tbody");
  let i = start + 2;
  for (; i < lines.length && lines[i].trim() && lines[i].includes("|"); i++) body.append(row(cells(lines[i]), "td"));
  parent.append(el("div", "table-wrap", el("table", null, el("thead", null, row(header, "th")), body)));
  return i;
}

function codeBlock(code, language) {
  const copy = el("button", "copy-code", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  copy.dataset.copy = code;
  const pre = el("pre", null, el("code", null, code));
  if (language) pre.firstChild.dataset.language = language;
  return el("div", "code-block", el("div", "code-head", el("span", null, language || "code"), copy), pre);
}

// Inline spans of one line: a list of nodes. Each rule finds its closing delimiter on the same line; an
// unmatched delimiter is plain text.
const INLINE_RULES = [
  { open: /^\\([\\`*_{}[\]()#+\-.!|~<>])/, make: (m) => [document.createTextNode(m[1]), m[0].length] },
  { open: /^(`+)([^]*?[^`])\1(?!`)/, make: (m) => [el("code", null, m[2].trim() || m[2]), m[0].length] },
  { open: /^\[([^\]]*)\]\(\s*<?([^\s)>]*)>?(?:\s+"[^"]*")?\s*\)/, make: (m) => [link(m[1], m[2]), m[0].length] },
  { open: /^<((?:https?:|mailto:)[^\s>]+)>/, make: (m) => [link(m[1], m[1]), m[0].length] },
  { open: /^\*\*(?=\S)([^]*?\S)\*\*/, make: (m) => [el("strong", null, ...inline(m[1])), m[0].length] },
  { open: /^__(?=\S)([^]*?\S)__(?![A-Za-z0-9_])/, make: (m) => [el("strong", null, ...inline(m[1])), m[0].length] },
  { open: /^~~(?=\S)([^]*?\S)~~/, make: (m) => [el("del", null, ...inline(m[1])), m[0].length] },
  { open: /^\*([^\s*](?:[^*]*?[^\s*])?)\*/, make: (m) => [el("em", null, ...inline(m[1])), m[0].length] },
  { open: /^_([^\s_](?:[^_]*?[^\s_])?)_(?![A-Za-z0-9_])/, make: (m) => [el("em", null, ...inline(m[1])), m[0].length] },
];

function inline(text) {
  const nodes = [];
  let plain = "";
  for (let i = 0; i < text.length;) {
    const rest = text.slice(i);
    // `_` inside a word (snake_case, __dunder__) is not emphasis
    const wordChar = i > 0 && /[A-Za-z0-9_]/.test(text[i - 1]);
    let matched = null;
    if ("\\`[<*_~".includes(rest[0]) && !(rest[0] === "_" && wordChar)) {
      for (const rule of INLINE_RULES) {
        const m = rule.open.exec(rest);
        if (m) {
          matched = rule.make(m);
          break;
        }
      }
    }
    if (matched) {
      if (plain) nodes.push(document.createTextNode(plain));
      plain = "";
      nodes.push(matched[0]);
      i += matched[1];
    } else {
      plain += rest[0];
      i++;
    }
  }
  if (plain) nodes.push(document.createTextNode(plain));
  return nodes;
}

// A link to an http(s) or mailto address; any other scheme (javascript:, data:) stays plain text.
function link(label, href) {
  if (!SAFE_URL.test(href)) return document.createTextNode(label || href);
  const a = el("a", null, ...inline(label || href));
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  return a;
}
