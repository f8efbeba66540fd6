"""Host scheduling, in the engine's process: which sequences run in the next step and with
which KV blocks (scheduler, block manager, sequence), what a request may ask for (request
validator), how output tokens become text (detokenizer, text pieces), and the n-gram speculator
that proposes draft tokens (spec_decode/). Nothing here touches a device."""
