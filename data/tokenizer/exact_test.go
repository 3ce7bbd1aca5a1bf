package tokenizer

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// checkAgainstHF encodes texts with tok and with HF tokenizers (under node)
// loaded from jsonPath, and reports every difference in ids, offsets or
// decoded text.
func checkAgainstHF(t *testing.T, tok *Tokenizer, jsonPath string, texts []string) {
	t.Helper()
	reqs := make([]refRequest, len(texts))
	for i, s := range texts {
		reqs[i] = refRequest{Impl: "hf", Tokenizer: jsonPath, Text: s}
	}
	res := reference(t).call(t, reqs)
	bad := 0
	for i, s := range texts {
		if msg := compareOne(tok, s, res[i]); msg != "" {
			bad++
			if bad <= 10 {
				t.Errorf("text %d %+q:\n%s", i, clip(s), msg)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d texts differ from HF tokenizers", bad, len(texts))
	}
}

func clip(s string) string {
	if len(s) > 200 {
		return s[:200] + "..."
	}
	return s
}

func compareOne(tok *Tokenizer, s string, want refResponse) string {
	ids, offs := tok.EncodeOffsets(s)
	if !slices.Equal(ids, want.IDs) {
		i := 0
		for i < len(ids) && i < len(want.IDs) && ids[i] == want.IDs[i] {
			i++
		}
		return fmt.Sprintf("ids differ at %d:\n got %v\nwant %v", i, window(ids, i), window(want.IDs, i))
	}
	if got := tok.Decode(ids); got != want.Decoded {
		return fmt.Sprintf("decode: got %+q want %+q", clip(got), clip(want.Decoded))
	}
	if len(offs) != len(ids) {
		return fmt.Sprintf("%d offsets for %d ids", len(offs), len(ids))
	}
	changed := tok.nfc && !norm.NFC.IsNormalString(s)
	for i, o := range offs {
		w := want.Offsets[i]
		if !changed && (o[0] < w[0] || o[1] > w[1]) {
			return fmt.Sprintf("token %d offsets %v outside HF's %v", i, o, w)
		}
		// HF widens a token that covers part of a character to the whole
		// character; our ranges are the bytes themselves, so they tile.
		if !changed {
			prev := 0
			if i > 0 {
				prev = offs[i-1][1]
			}
			_, isAdded := tok.addedByID[ids[i]]
			if o[0] != prev || (!isAdded && s[o[0]:o[1]] != tok.idToRaw[ids[i]]) {
				return fmt.Sprintf("token %d offsets %v do not cover its bytes %q (prev end %d)", i, o, tok.idToRaw[ids[i]], prev)
			}
		}
	}
	if !changed && len(offs) > 0 && offs[len(offs)-1][1] != len(s) {
		return fmt.Sprintf("offsets end at %d, text has %d bytes", offs[len(offs)-1][1], len(s))
	}
	return ""
}

func window(ids []int32, i int) []int32 {
	return ids[max(0, i-3):min(len(ids), i+5)]
}

func TestExactQwen3(t *testing.T) {
	tok := loadModel(t, "qwen3")
	checkAgainstHF(t, tok, filepath.Join(modelDir(t, "qwen3"), "tokenizer.json"), corpus())
}

func TestExactLlama3(t *testing.T) {
	tok := loadModel(t, "llama3")
	checkAgainstHF(t, tok, filepath.Join(modelDir(t, "llama3"), "tokenizer.json"), corpus())
}

var _ = strings.Repeat
var _ = utf8.RuneError

// TestPreTokenizerExact compares the scanners with HF's pre-tokenizer
// (Oniguruma running the regex from tokenizer.json) piece by piece, which
// catches split differences that BPE would happen to hide.
func TestPreTokenizerExact(t *testing.T) {
	for _, name := range []string{"qwen3", "llama3"} {
		t.Run(name, func(t *testing.T) {
			tok := loadModel(t, name)
			texts := corpus()
			reqs := make([]refRequest, len(texts))
			for i, s := range texts {
				reqs[i] = refRequest{Impl: "hf", Op: "pretok", Tokenizer: filepath.Join(modelDir(t, name), "tokenizer.json"), Text: s}
			}
			res := reference(t).call(t, reqs)
			bad := 0
			for i, s := range texts {
				want := make([]int, len(res[i].Offsets))
				for k, o := range res[i].Offsets {
					want[k] = o[1]
				}
				got := splitPreTokens(tok.pattern, s, nil)
				if !slices.Equal(got, want) {
					bad++
					if bad <= 10 {
						t.Errorf("text %+q:\n got %q\nwant %q", clip(s), pieces(s, got), pieces(s, want))
					}
				}
			}
			if bad > 0 {
				t.Errorf("%d of %d texts split differently from HF", bad, len(texts))
			}
		})
	}
}

func pieces(s string, ends []int) []string {
	var out []string
	prev := 0
	for _, e := range ends {
		if e < prev || e > len(s) {
			return append(out, fmt.Sprintf("<bad end %d>", e))
		}
		out = append(out, s[prev:e])
		prev = e
	}
	return out
}
