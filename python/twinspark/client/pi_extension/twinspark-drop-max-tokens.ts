// Installed by `invoke pi-install` (twinspark). Drops max_tokens / max_completion_tokens from requests to the
// twinspark provider only: vLLM reserves max_tokens of the context for the answer, so Pi's large default makes
// long conversations fail with a context-length error; without it the server uses the room that is left.
import type { ExtensionAPI } from "@earendil-works/pi-coding-agent";

const PROVIDER = "__PROVIDER__";

export default function (pi: ExtensionAPI) {
  pi.on("before_provider_request", (event, ctx) => {
    if (ctx.model?.provider !== PROVIDER) return undefined;
    const payload = event.payload;
    if (!payload || typeof payload !== "object" || Array.isArray(payload)) return undefined;
    const { max_tokens, max_completion_tokens, ...rest } = payload as Record<string, unknown>;
    if (max_tokens === undefined && max_completion_tokens === undefined) return undefined;
    return rest;
  });
}
