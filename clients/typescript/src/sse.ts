/**
 * Server-sent events read from a fetch body, as the WHATWG HTML standard defines the
 * format: lines end with CRLF, LF or CR; `field: value` (one space after the colon
 * dropped); comments start with a colon; a blank line ends the event; `data` lines join
 * with newlines. Written here (not an EventSource) because EventSource cannot send an
 * Authorization header, and browsers' and Node's fetch both stream a body.
 */

export interface ServerSentEvent {
  id: string | undefined;
  event: string;
  data: string;
}

/** A stream that brought nothing (not even a comment) for the idle time. */
export class StreamIdleError extends Error {
  override name = "StreamIdleError";
}

/** The events of `body` in order; ends when the body ends (a last unterminated event is
 * dropped, as the standard says). With `idleMs`, a read that waits longer than that
 * throws StreamIdleError: a connection whose peer vanished without a FIN or RST. */
export async function* readEvents(body: ReadableStream<Uint8Array>, idleMs = 0
): AsyncGenerator<ServerSentEvent> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data: string[] = [];
  let event = "";
  let id: string | undefined;
  try {
    for (;;) {
      const { value, done } = await (idleMs > 0 ? within(reader.read(), idleMs) : reader.read());
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      for (;;) {
        const end = buffer.search(/\r\n|\r|\n/);
        // A CR at the very end may be the first half of a CRLF still on its way.
        if (end < 0 || (end === buffer.length - 1 && buffer[end] === "\r" && !done)) break;
        const line = buffer.slice(0, end);
        buffer = buffer.slice(end + (buffer.startsWith("\r\n", end) ? 2 : 1));
        if (line === "") {
          if (data.length > 0) yield { id, event: event || "message", data: data.join("\n") };
          data = [];
          event = "";
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") data.push(value);
        else if (field === "event") event = value;
        else if (field === "id" && !value.includes("\0")) id = value;
      }
      if (done) return;
    }
  } finally {
    // An early break (the consumer stopped) or an error: release the connection.
    await reader.cancel().catch(() => undefined);
  }
}

function within<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const idle = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => reject(new StreamIdleError(`nothing received for ${ms} ms`)), ms);
  });
  return Promise.race([promise, idle]).finally(() => clearTimeout(timer));
}
