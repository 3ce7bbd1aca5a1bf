// Package serve is the teacher daemon's core and transport: it serves a
// loaded teacher (package infer) over the distill.v1.Teacher gRPC API
// (proto/distill/v1) and drives cache fills (package cache) over datasets
// (package data), in a daemon (teacherd) or in-process (cachectl fill
// --model).
//
// # Pieces
//
//	Core      the loaded model and tokenizer, the batcher, datasets and
//	          the cache directory; Info, Score, DescribeDataset, Fill, Status
//	Server    thin gRPC handlers over a Core: validate -> confine the
//	          dataset paths to the data roots -> core -> clientStatus;
//	          auth (bearer token), request ids and the concurrency limit
//	          are interceptors
//	Daemon    listener, health (NOT_SERVING until the model is loaded),
//	          reflection, Prometheus /metrics, graceful drain (Start, Shutdown)
//	RunFill   the fill driver: several Workers (daemons via Dial, or a Core
//	          via Local) over disjoint chunks, resumable and retried
//
// # Batching
//
// One goroutine runs forward passes one at a time (a forward uses every
// core). Work waits in a queue bounded in items and tokens: Score samples
// that find it full fail with ErrOverloaded (RESOURCE_EXHAUSTED), fill work
// waits for room. Score samples from all streams are packed together, in
// queue order, up to the token budget (same temperature; the largest k,
// rows cut for smaller ones). A Score sample of a sampled kind (targets
// sampled or head+sampled) shares a forward only with samples asking for
// the same draws (N, head and k); its draws are keyed by the dataset
// fingerprint and sample index it gives, as a fill's, so it answers what a
// Fill of that sample stores where the probabilities agree. A fill chunk is packed on its own, greedily
// in order exactly as infer.Model.TopK packs it, and each of its forward
// groups runs alone: GEMM rounding depends on the batch shape, and this way
// a chunk's cached top-k is bit for bit what the in-process forward gives,
// whatever else the daemon serves at the time.
//
// # Fill and crash safety
//
// A Fill request covers [start, end); the daemon skips the chunks its
// cache has, computes the missing ones FillChunksInFlight at a time, and
// commits each chunk atomically (package cache), so a daemon killed at
// any instant leaves whole chunks or nothing. RunFill asks every teacher
// which ranges its cache directory holds, hands out only missing chunks,
// gives a failed teacher's chunks to the others, and checks at the end that
// every sample of the range is covered. One window is left: a teacher that
// commits a chunk and dies before reporting it has its chunk redone
// elsewhere, so two directories hold the same range. Both copies are whole
// chunks of the same teacher and a reader of the directories as one cache
// uses one of them, so the fill reports the duplicate and succeeds; ranges
// that overlap without being equal (different --chunk) are an error.
//
// # Security
//
// A client names dataset files on the daemon's machine, so the Server
// reads only files under its DataRoots (teacherd --data-root; none: no
// file), after resolving symlinks and "..", and its refusals do not tell a
// file outside the roots from a missing one. The daemon listens on
// loopback unless told otherwise, and refuses an address other machines
// can reach without a token or TLS unless Config.Insecure; refused calls
// count in teacherd_auth_failures_total. The in-process teacher (Local) is
// the user's own process and is not confined.
//
// # Errors
//
// Errors wrap the sentinels of this package or of packages infer, cache
// and data; code maps them with errors.Is (InvalidArgument, OutOfRange,
// NotFound, FailedPrecondition, ResourceExhausted, Unavailable), context
// errors pass through, anything else is Internal. A remote client's
// message (clientStatus) leaks neither internals nor file content: an
// internal error, the detail of a bad record and the text of an
// unreadable dataset file are logged under the call's request id, and the
// client gets the code, what can be said safely, and that id. The
// in-process teacher (toStatus) keeps every detail. A panic in a forward
// pass, in the batcher's goroutine or in a kernel's worker goroutine
// (package cpu carries it back), fails that pass's requests with Internal;
// the daemon goes on.
package serve
