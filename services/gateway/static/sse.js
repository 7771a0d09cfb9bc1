// Reads an OpenAI-style SSE body from fetch: yields each `data:` JSON; ends on [DONE].
// Comment lines (": keep-alive") and other fields are skipped, as EventSource would.
"use strict";

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = localStorage.getItem("splitserve.apiKey");
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}
