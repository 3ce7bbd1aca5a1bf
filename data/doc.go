// Package data turns datasets into tokenized samples for distillation: token
// ids plus a loss mask, at a deterministic index i = 0..N-1 that the teacher
// fill ([start, end) ranges) and the student both use.
//
// # Sources and record shapes
//
// A source is a JSON Lines (.jsonl/.ndjson/.json), CSV (header row) or
// Parquet (HF datasets) file. Each record is one of, checked in this order:
//
//	{"messages": [{"role", "content"}, ...]}  chat; roles system/user/assistant/tool
//	{"input_ids": [...], "loss_mask": [...]}  pre-tokenized; loss_mask optional (all 1)
//	{"prompt", "response", "system"?}          prompt/response
//	{"text"}                                   plain text
//
// ColumnMap renames fields (ShareGPT: messages=conversations, role=from,
// content=value, Roles human->user, gpt->assistant). In CSV, the messages,
// input_ids and loss_mask cells hold JSON. Assistant messages may carry
// reasoning_content and tool_calls; a record's "tools" go to the template.
// Key order inside tool calls and tools is kept for JSONL (tojson prints it);
// Parquet structs keep their field order, plain JSON maps elsewhere are sorted.
//
// # Masks
//
// Mask[t] = 1 means token t is a training target (HF labels != -100); the
// loss at position t-1 predicts it.
//
//   - text: every token (BOS, when added, is not a target). EOS is appended
//     unless Options.NoEOS (TRL's SFT does the same for language modeling).
//   - prompt/response: with a chat template, a [system,] user, assistant chat;
//     without one (base models), BOS + tokens(system+prompt) +
//     tokens(response) + EOS, tokenized as two pieces so the prompt tokens are
//     those the model sees at inference; targets are response + EOS.
//   - chat: only assistant turns. The conversation is rendered once and
//     tokenized once (EncodeOffsets); a token is a target if its bytes overlap
//     an assistant span. Templates with {% generation %} blocks give the spans
//     (transformers' return_assistant_tokens_mask). Otherwise turn i starts
//     where render(messages[:i], add_generation_prompt=true) ends, which must
//     be a prefix of the full rendering (the prefix property; if only the
//     generation prompt differs, as in Qwen3 with enable_thinking=false, the
//     turn starts where the two depart); it ends after the template's
//     end-of-turn marker following the turn's content. The marker is probed
//     once per template: the text both "answer is last" and "answer then a
//     user turn" renderings put after the answer, cut to its first token
//     (<|im_end|> for ChatML, <|eot_id|> for Llama 3), so the "\n" ChatML
//     writes after <|im_end|> and the next header are not targets. Whatever the
//     template puts inside the turn is a target: Qwen3's think block, tool
//     calls. Templates that break the prefix property fail with ErrTemplate.
//   - pre-tokenized: as given; ids are checked against the vocabulary.
//     A dataset opened with IDsOnly (no tokenizer) takes input_ids records
//     only: one with text instead is a bad record; text beside the ids (a
//     column HF's datasets.map kept) is not read.
//
// BOS is prepended when the tokenizer's AddBOS says so and the rendering does
// not already start with it (Llama 3 templates write it themselves).
//
// # Length policy
//
// MaxLen with Policy Truncate keeps the first MaxLen tokens (a sample left
// without targets is dropped); Drop empties the sample. Dropped and skipped
// samples keep their index with Status set and no tokens, so the index never
// shifts; Stats counts them with reasons and examples (file:line).
//
// # Index, blends and shuffling
//
// With no weights, sources are concatenated: N = total records, in file
// order. With weights (all sources), the blend follows Megatron-LM's
// BlendedDataset: weights are proportions over a fixed total N (default: the
// total number of records; Options.NumSamples sets it). They are quantized to
// integer shares W_d (exact for decimal ratios such as 0.3/0.7, else
// 1/65536), and each period of sum(W_d) samples holds exactly W_d samples of
// source d, interleaved greedily ("furthest behind its share goes next"), so
// every prefix is within one sample per source of the target proportions.
// A source that runs out starts a new epoch. Shuffle permutes each epoch of
// each source with a keyed Feistel permutation (seeded by Seed, the source
// number and the epoch): O(1) memory, random access, integer-only so it is
// identical everywhere. Concatenated sources are, in addition, mixed by one
// such permutation over the whole index. Sample i is located in O(1) (blend) or O(log S)
// (concatenation) without materializing the index.
//
// # Random access and streaming
//
// Open makes one streaming pass per file (1 MiB reads): SHA-256 of the bytes
// and the byte offset of each record (8 bytes per record, plus sparse line
// numbers for error messages), so a 10 GB JSONL file is never loaded.
// Range(start, end) reads just those records (pread) and tokenizes them on
// Options.Workers goroutines, returning them in index order. Parquet is read
// a row group at a time (the last two are cached). Compressed files are
// refused: they cannot be read at an offset.
//
// # Fingerprint
//
// Fingerprint is SHA-256 over a versioned, canonical JSON of the sources'
// content hashes, formats, column maps and weights; the tokenizer's
// fingerprint; the chat template source and variables; and every option that
// changes tokens (N, MaxLen, Policy, SkipBad, Shuffle, Seed, NoEOS). Bump
// fingerprintVersion when tokenization rules change.
//
// # Errors
//
// Bad records return a *RecordError (file:line or file:row N, field path,
// reason, hint) wrapping ErrBadRecord or ErrTemplate; Options.SkipBad turns
// those into Skipped samples. Unreadable sources wrap ErrSource, bad options
// ErrOptions; those are never skipped.
package data
