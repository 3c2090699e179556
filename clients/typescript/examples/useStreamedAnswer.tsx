// A React hook that shows a calmq job's answer as the model writes it, and a component
// that uses it. Type-checked by `npm run build` (examples/tsconfig.json); React is a
// devDependency of the package for its types only: copy this file into your app.
//
// The API key must not reach a browser: in a web app, point `baseUrl` at a route of your
// own backend that adds the tenant's key (or proxies /v1/jobs/{id}/events), and pass
// `apiKey: ""`; the hook is the same either way.
import { useEffect, useState } from "react";

import { CalmqClient, type Status } from "@calmq/client";

export interface StreamedAnswer {
  /** The answer so far (the streamed step's text; starts over if a new attempt does). */
  text: string;
  /** The job's status once its stream ended; undefined while it runs. */
  status: Status | undefined;
  error: Error | undefined;
}

/** Follows `jobId`'s streamed output until the job ends; resumes across dropped
 * connections by itself; stops when the component unmounts or `jobId` changes. */
export function useStreamedAnswer(client: CalmqClient, jobId: string | undefined
): StreamedAnswer {
  const [state, setState] = useState<StreamedAnswer>(
    { text: "", status: undefined, error: undefined });
  useEffect(() => {
    if (jobId === undefined) return undefined;
    const stop = new AbortController();
    setState({ text: "", status: undefined, error: undefined });
    void (async () => {
      try {
        for await (const piece of client.output(jobId, { signal: stop.signal })) {
          setState((s) => ({ ...s, text: piece.reset ? "" : s.text + piece.text }));
        }
        const job = await client.get(jobId, { signal: stop.signal });
        setState((s) => ({ ...s, status: job.status }));
      } catch (error) {
        if (!stop.signal.aborted) {
          setState((s) => ({ ...s, error: error instanceof Error ? error : new Error(String(error)) }));
        }
      }
    })();
    return () => stop.abort();
  }, [client, jobId]);
  return state;
}

/** Ask for a draft and show it as it is written. */
export function DraftBox({ client, prompt }: { client: CalmqClient; prompt: string }) {
  const [jobId, setJobId] = useState<string>();
  const answer = useStreamedAnswer(client, jobId);
  const ask = async (): Promise<void> => {
    const accepted = await client.submit("draft", { prompt }, { priority: "interactive" });
    setJobId(accepted.job_id);
  };
  return (
    <div>
      <button onClick={() => void ask()} disabled={jobId !== undefined && !answer.status}>
        Draft
      </button>
      <p aria-live="polite">{answer.text}</p>
      {answer.error ? <p role="alert">{answer.error.message}</p> : null}
      {answer.status && answer.status !== "completed" ? <p>The job ended {answer.status}.</p> : null}
    </div>
  );
}
