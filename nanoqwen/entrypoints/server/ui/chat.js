// The chat page: conversations kept in localStorage, answers streamed from the server's own
// /v1/chat/completions (the API every client uses), reasoning shown in a "Thinking" block.
import { renderMarkdown } from "./markdown.js";

const STORAGE = {
  conversations: "nanoqwen.conversations",
  current: "nanoqwen.current",
  settings: "nanoqwen.settings",
  apiKey: "nanoqwen.apiKey",
};
const SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "seed"];
const $ = (id) => document.getElementById(id);

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const state = {
  conversations: load(STORAGE.conversations, []),
  currentId: load(STORAGE.current, null),
  settings: { thinking: true, ...load(STORAGE.settings, {}) },
  props: null, // the server's /props: model name and default sampling
  streaming: null, // { controller, message } while an answer streams
};
const articles = new WeakMap(); // message -> its <article>

function persist() {
  try {
    localStorage.setItem(STORAGE.conversations, JSON.stringify(state.conversations));
    localStorage.setItem(STORAGE.current, JSON.stringify(state.currentId));
    localStorage.setItem(STORAGE.settings, JSON.stringify(state.settings));
  } catch (e) {
    notice(`Could not save the conversations in this browser: ${e.message}`);
  }
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

function button(label, action, text = label) {
  const b = el("button", null, text);
  b.type = "button";
  b.setAttribute("aria-label", label);
  b.dataset.action = action;
  return b;
}

// ---------------------------------------------------------------- the server

async function api(path, options = {}, mayAskKey = true) {
  const key = localStorage.getItem(STORAGE.apiKey);
  const headers = { ...options.headers };
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401 && mayAskKey && (await askApiKey())) return api(path, options, false);
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = `${response.status}: ${(await response.json()).error.message}`;
    } catch {
      // not an OpenAI-shaped error: keep the status line
    }
    throw new Error(message);
  }
  return response;
}

function askApiKey() {
  const dialog = $("api-key");
  const input = dialog.querySelector("input");
  input.value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = input.value.trim();
      if (dialog.returnValue === "save" && key) localStorage.setItem(STORAGE.apiKey, key);
      resolve(dialog.returnValue === "save" && Boolean(key));
    }, { once: true });
  });
}

// The events of an OpenAI stream ("data: {...}" blocks, then "data: [DONE]").
async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
  throw new TypeError("the stream ended early");
}

async function loadProps() {
  try {
    state.props = await (await api("props")).json();
    $("model-name").textContent = state.props.model_alias;
    document.title = `${state.props.model_alias} · nanoqwen`;
  } catch (e) {
    notice(`Could not read the server's settings (${e.message}).`);
  }
}

// ---------------------------------------------------------------- conversations

function current() {
  return state.conversations.find((c) => c.id === state.currentId);
}

function newConversation() {
  const id = globalThis.crypto?.randomUUID?.() ?? `${Date.now()}-${Math.random().toString(36).slice(2)}`;
  const conversation = { id, title: "New chat", messages: [] };
  state.conversations.unshift(conversation);
  state.currentId = id;
  persist();
  render();
  return conversation;
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const open = button(c.title, "open", c.title);
    open.className = "conversation";
    open.dataset.id = c.id;
    if (c.id === state.currentId) open.setAttribute("aria-current", "true");
    const remove = button(`Delete conversation ${c.title}`, "delete", "×");
    remove.dataset.id = c.id;
    return el("li", null, open, remove);
  }));
}

function render() {
  renderSidebar();
  const conversation = current();
  const messages = conversation ? conversation.messages : [];
  $("messages").replaceChildren(...messages.map((m, i) => renderMessage(m, i, i === messages.length - 1)));
  setBusy(Boolean(state.streaming));
}

function renderMessage(message, index, isLast) {
  const article = el("article", `message ${message.role}`);
  article.dataset.index = index;
  articles.set(message, article);
  if (message.role === "assistant") {
    const thinking = el("details", "thinking", el("summary", null, "Thinking"), el("div", "reasoning"));
    thinking.open = !message.content && message === state.streaming?.message;
    article.append(thinking, el("div", "content"), el("p", "error"), el("p", "stats"),
                   el("div", "actions", button("Copy", "copy"),
                      ...(isLast ? [button("Regenerate", "regenerate")] : [])));
  } else {
    article.append(el("div", "content"), el("div", "actions", button("Copy", "copy"), button("Edit", "edit")));
  }
  updateMessage(message);
  return article;
}

// Redraws one message's text, reasoning, error and speed line.
function updateMessage(message) {
  const article = articles.get(message);
  if (!article) return;
  const content = article.querySelector(".content");
  if (message.role === "user") {
    content.textContent = message.content;
    return;
  }
  content.replaceChildren(renderMarkdown(message.content));
  const thinking = article.querySelector(".thinking");
  thinking.hidden = !message.reasoning;
  thinking.querySelector(".reasoning").textContent = message.reasoning;
  if (message.content && !article.dataset.answered) {
    thinking.open = false; // the answer has started: fold the reasoning away
    article.dataset.answered = "true";
  }
  const error = message.error ?? (message.stopped ? "Stopped." : "");
  article.querySelector(".error").textContent = error;
  article.querySelector(".error").hidden = !error;
  article.querySelector(".stats").textContent = message.stats ?? "";
  article.classList.toggle("streaming", message === state.streaming?.message);
}

let pendingFrame = null;
function scheduleUpdate(message) {
  pendingFrame ??= requestAnimationFrame(() => {
    pendingFrame = null;
    updateMessage(message);
    const box = $("messages");
    if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  });
}

function setBusy(busy) {
  $("stop").hidden = !busy;
  $("send").disabled = busy;
  for (const b of document.querySelectorAll("[data-action=regenerate], [data-action=edit]")) b.disabled = busy;
}

// ---------------------------------------------------------------- asking and answering

function requestBody(conversation, answer) {
  const s = state.settings;
  const messages = s.system?.trim() ? [{ role: "system", content: s.system }] : [];
  for (const m of conversation.messages) {
    if (m === answer) break;
    if (m.role === "assistant" && !m.content) continue; // an answer that failed before its first token
    messages.push({ role: m.role, content: m.content });
  }
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: Boolean(s.thinking) },
  };
  if (state.props?.model_alias) body.model = state.props.model_alias;
  for (const field of SAMPLING_FIELDS) {
    if (s[field] !== undefined && s[field] !== null && s[field] !== "") body[field] = Number(s[field]);
  }
  return body;
}

// "12 prompt tokens, 85 ms to first token · 64 tokens, 25.1 tok/s": the server's timings when it sent them.
function speedLine(usage, timings, clientFirstMs, clientSeconds) {
  const firstMs = timings ? timings.prompt_ms : clientFirstMs;
  const generated = usage.completion_tokens;
  const perSecond = timings ? timings.predicted_per_second : generated / clientSeconds;
  const first = firstMs == null ? "" : `, ${Math.round(firstMs)} ms to first token`;
  const speed = Number.isFinite(perSecond) && perSecond > 0 ? `, ${perSecond.toFixed(1)} tok/s` : "";
  return `${usage.prompt_tokens} prompt tokens${first} · ${generated} tokens${speed}`;
}

async function streamAnswer(conversation) {
  const message = { role: "assistant", content: "", reasoning: "" };
  conversation.messages.push(message);
  const controller = new AbortController();
  state.streaming = { controller, message };
  persist();
  render();
  $("messages").scrollTop = $("messages").scrollHeight;
  const started = performance.now();
  let firstToken = null;
  try {
    const response = await api("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conversation, message)), signal: controller.signal,
    });
    for await (const event of serverSentEvents(response)) {
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices?.[0]?.delta ?? {};
      if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
      // (the answer's text, without the blank lines Qwen3 writes after its reasoning)
      if (delta.content) message.content = (message.content + delta.content).replace(/^\s+/, "");
      if (firstToken === null && (delta.reasoning_content || delta.content)) firstToken = performance.now();
      if (event.usage) {
        const seconds = (performance.now() - (firstToken ?? started)) / 1000;
        message.stats = speedLine(event.usage, event.timings, firstToken && firstToken - started, seconds);
      }
      scheduleUpdate(message);
    }
  } catch (e) {
    if (e.name === "AbortError") message.stopped = true;
    else if (e instanceof TypeError) message.error = `The connection to the server was lost (${e.message}).`;
    else message.error = e.message;
  } finally {
    state.streaming = null;
    persist();
    updateMessage(message);
    setBusy(false);
  }
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.streaming) return;
  const conversation = current() ?? newConversation();
  if (!conversation.messages.length) conversation.title = text.trim().split("\n")[0].slice(0, 60);
  conversation.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  notice("");
  streamAnswer(conversation);
}

function editMessage(index) {
  const conversation = current();
  const article = $("messages").children[index];
  const editor = el("textarea", "editor");
  editor.value = conversation.messages[index].content;
  editor.setAttribute("aria-label", "Edit message");
  const save = button("Save and send", "save-edit", "Save and send");
  const cancel = button("Cancel edit", "cancel-edit", "Cancel");
  article.querySelector(".content").replaceChildren(editor);
  article.querySelector(".actions").replaceChildren(cancel, save);
  editor.focus();
  save.addEventListener("click", () => {
    if (!editor.value.trim() || state.streaming) return;
    conversation.messages.splice(index); // this message and everything after it
    conversation.messages.push({ role: "user", content: editor.value });
    streamAnswer(conversation);
  });
  cancel.addEventListener("click", render);
}

async function copyText(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API (a page not on localhost or https): copy through a selected textarea
    const area = el("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = target.textContent;
  target.textContent = "Copied";
  setTimeout(() => { target.textContent = label; }, 1200);
}

// ---------------------------------------------------------------- settings, export, import

function openSettings() {
  const form = $("settings-form");
  const defaults = state.props?.default_generation_settings?.params ?? {};
  form.elements.system.value = state.settings.system ?? "";
  for (const field of SAMPLING_FIELDS) {
    const input = form.elements[field];
    input.value = state.settings[field] ?? "";
    const fallback = field === "max_tokens" ? "up to the context limit" : field === "seed" ? "random" : "";
    input.placeholder = defaults[field] ?? fallback;
  }
  $("settings").showModal();
}

function saveSettings() {
  const form = $("settings-form");
  state.settings.system = form.elements.system.value;
  for (const field of SAMPLING_FIELDS) state.settings[field] = form.elements[field].value;
  persist();
}

function exportConversation() {
  const conversation = current();
  if (!conversation) return notice("There is no conversation to export.");
  const data = { nanoqwen_conversation: 1, title: conversation.title,
                 messages: conversation.messages.map(({ role, content, reasoning }) => ({ role, content, reasoning })) };
  const link = el("a");
  link.href = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  link.download = `${conversation.title.replace(/[^\w -]+/g, "").trim() || "conversation"}.json`;
  link.click();
  URL.revokeObjectURL(link.href);
}

async function importConversation(file) {
  try {
    const data = JSON.parse(await file.text());
    const valid = Array.isArray(data.messages) && data.messages.every((m) =>
      (m.role === "user" || m.role === "assistant") && typeof m.content === "string");
    if (!valid) throw new Error("expected {title, messages: [{role: user|assistant, content}]}");
    const conversation = newConversation();
    conversation.title = String(data.title || file.name);
    conversation.messages = data.messages.map((m) => ({
      role: m.role, content: m.content, ...(m.role === "assistant" ? { reasoning: String(m.reasoning ?? "") } : {}) }));
    persist();
    render();
  } catch (e) {
    notice(`${file.name} is not a conversation exported from this page: ${e.message}`);
  }
}

// ---------------------------------------------------------------- wiring

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => state.streaming?.controller.abort());
$("thinking").checked = state.settings.thinking;
$("thinking").addEventListener("change", (e) => {
  state.settings.thinking = e.target.checked;
  persist();
});
$("new-chat").addEventListener("click", () => {
  if (!state.streaming) newConversation();
  $("prompt").focus();
});
$("open-settings").addEventListener("click", openSettings);
$("settings").addEventListener("close", () => {
  if ($("settings").returnValue === "save") saveSettings();
});
$("reset-settings").addEventListener("click", () => {
  for (const field of ["system", ...SAMPLING_FIELDS]) $("settings-form").elements[field].value = "";
});
$("export").addEventListener("click", exportConversation);
$("import").addEventListener("change", (e) => {
  if (e.target.files[0]) importConversation(e.target.files[0]);
  e.target.value = "";
});
// on a narrow screen the conversation list slides over the page: the ☰ button opens it; a click beside it or
// Escape closes it
function showSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}
$("toggle-sidebar").addEventListener("click", (e) => {
  e.stopPropagation();
  showSidebar(!document.body.classList.contains("sidebar-open"));
});
document.querySelector("main").addEventListener("click", () => showSidebar(false));
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") showSidebar(false);
});

$("conversations").addEventListener("click", (e) => {
  const target = e.target.closest("button");
  if (!target || state.streaming) return;
  if (target.dataset.action === "open") {
    state.currentId = target.dataset.id;
    showSidebar(false);
  } else if (target.dataset.action === "delete") {
    const conversation = state.conversations.find((c) => c.id === target.dataset.id);
    if (!confirm(`Delete "${conversation.title}"?`)) return;
    state.conversations = state.conversations.filter((c) => c !== conversation);
    if (state.currentId === conversation.id) state.currentId = state.conversations[0]?.id ?? null;
  }
  persist();
  render();
});

$("messages").addEventListener("click", (e) => {
  const target = e.target.closest("button");
  if (!target) return;
  if (target.dataset.copy !== undefined) return copyText(target.dataset.copy, target);
  const index = Number(target.closest("article")?.dataset.index);
  const conversation = current();
  const message = conversation?.messages[index];
  if (target.dataset.action === "copy") {
    copyText(message.content, target);
  } else if (target.dataset.action === "edit" && !state.streaming) {
    editMessage(index);
  } else if (target.dataset.action === "regenerate" && !state.streaming) {
    conversation.messages.splice(index);
    streamAnswer(conversation);
  }
});

render();
loadProps();
