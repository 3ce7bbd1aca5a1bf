// Package tokenizer is a pure-Go implementation of the HF byte-level BPE
// tokenizers used by Qwen2/Qwen2.5/Qwen3 and Llama 3 (and GPT-2-style
// ByteLevel tokenizers), loaded from an HF tokenizer.json and
// tokenizer_config.json. Its token ids are those of HF tokenizers (the Rust
// library behind transformers' fast tokenizers), which the tests check on
// the real Qwen3 and Llama 3 files against HF tokenizers run under node.
//
// # Pipeline (as HF tokenizers, encode without special tokens added)
//
//  1. Added tokens with normalized=false are cut out of the raw text:
//     non-overlapping leftmost-longest matches, then single_word filtering
//     and lstrip/rstrip widening.
//  2. Each remaining piece is normalized (NFC for Qwen; none for Llama 3),
//     then added tokens with normalized=true are cut out of it.
//  3. The Split pre-tokenizer cuts the rest with the model's regex. The
//     regexes use a lookahead Go's regexp lacks, so each known regex is a
//     hand-written scanner reproducing Oniguruma's leftmost-first,
//     backtracking match (see pretok.go); an unknown regex is an error.
//     Qwen2/3 take digits one at a time (\p{N}), Llama 3 up to three
//     (\p{N}{1,3}).
//  4. Each pre-token is BPE-merged on raw bytes (lowest merge rank first,
//     leftmost among equals), with a sharded cache of pre-token -> ids and,
//     for Llama 3 (ignore_merges), a whole-word vocabulary lookup first.
//
// Ids of added tokens are assigned as HF assigns them when it reads
// tokenizer.json (the file's ids are only checked by HF, with a warning);
// for the files of real models both agree.
//
// # Where behaviour is defined here rather than copied
//
//   - Offsets are byte ranges of the input. A byte-level token covering part
//     of a character gets exactly its bytes (HF widens it to the character);
//     tokens from a segment the normalizer changed get the whole segment.
//   - Decode does not replace invalid UTF-8 with U+FFFD, so decoding a
//     prefix of ids and then the rest gives the whole text, and an added
//     token decodes to its (normalized) content verbatim, where HF's
//     ByteLevel decoder would re-map contents whose every rune is in the
//     byte alphabet (no real model's added tokens are affected: they are
//     ASCII without spaces).
//   - Invalid UTF-8 input (which HF cannot take) is tokenized as its bytes,
//     each invalid byte counting as a punctuation-like rune.
//   - Character classes use Go's Unicode 15.0 tables and NFC uses
//     golang.org/x/text; HF uses Oniguruma's and an older normalization
//     crate. Characters whose properties changed between those versions
//     could split differently; the random tests draw from characters
//     assigned in Unicode 15.0 and have found no difference.
//
// transformers.js, by contrast, cannot be exact: it runs the regexes as
// JavaScript regexes, whose \s counts U+FEFF and not U+0085, and it rewrites
// (?i:'s|...) as [sS]-style classes, which do not match "'ſ".
//
// # Fingerprint (format)
//
// Fingerprint is the hex SHA-256 of this byte stream, where str(s) is
// uvarint(len(s)) followed by s, num(n) is uvarint(n) and flag(b) is num(0|1):
//
//	str("distill/tokenizer fingerprint v1")
//	flag(NFC) str(pattern: "qwen2"|"llama3"|"gpt2") flag(ignore_merges)
//	num(max vocab id + 1), then for each vocab id in order: num(id) str(raw bytes)
//	num(#merges), then for each merge by rank: str(left) str(right)   (byte-level form)
//	num(#added), then by id: num(id) str(content) flag(single_word)
//	    flag(lstrip) flag(rstrip) flag(normalized) flag(special)
//	str(TemplateProcessing's first special token) str(bos_token) str(eos_token)
//	flag(AddBOS()) flag(add_eos_token) str(chat template)
//
// It does not depend on JSON formatting or key order. Changing this layout
// changes every fingerprint recorded in caches: bump the version string.
package tokenizer
