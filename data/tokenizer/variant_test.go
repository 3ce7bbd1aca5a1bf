package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// writeVariant copies a real tokenizer directory into a temp dir after
// edit has changed the parsed tokenizer.json, so that behaviours the real
// files do not exercise (GPT-2 regex, lstrip/rstrip/single_word, normalized
// added tokens, a BOS template) are still checked against HF.
func writeVariant(t *testing.T, model string, edit func(m map[string]any)) string {
	t.Helper()
	src := modelDir(t, model)
	raw, err := os.ReadFile(filepath.Join(src, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), out, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(src, "tokenizer_config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestVariantGPT2Regex(t *testing.T) {
	dir := writeVariant(t, "qwen3", func(m map[string]any) {
		m["pre_tokenizer"] = map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true}
	})
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if tok.pattern != patGPT2 {
		t.Fatalf("pattern %v, want gpt2", tok.pattern)
	}
	checkAgainstHF(t, tok, filepath.Join(dir, "tokenizer.json"), corpus()[:800])
}

func TestVariantAddedTokenFlags(t *testing.T) {
	dir := writeVariant(t, "qwen3", func(m map[string]any) {
		added := m["added_tokens"].([]any)
		for _, a := range added {
			a := a.(map[string]any)
			switch a["content"] {
			case "<|im_end|>":
				a["lstrip"], a["rstrip"] = true, true
			case "</think>":
				a["single_word"] = true
			case "<think>":
				a["rstrip"] = true
			}
		}
		// normalized=true tokens match the NFC form of their content in the
		// normalized text: the jamo sequence must also match the syllable
		// "각". "word" is in the vocabulary, so HF gives it the vocab id
		// whatever the file says; the last one gets the next free id.
		added = append(added,
			map[string]any{"id": 151669, "content": "\u1100\u1161\u11a8", "single_word": false, "lstrip": false, "rstrip": false, "normalized": true, "special": false},
			map[string]any{"id": 151670, "content": "word", "single_word": true, "lstrip": false, "rstrip": false, "normalized": true, "special": false},
			map[string]any{"id": 151671, "content": "<|im_end|>x", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
		)
		m["added_tokens"] = added
	})
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	texts := []string{
		"a  <|im_end|>  b", "<|im_end|>\n\nx", "\t<|im_end|>", "a<|im_end|>xy", "<|im_end|><|im_end|>  <|im_end|>",
		"x</think>y", "x </think> y", "</think>", "é</think>", "1</think>", "_</think>", "-</think>-",
		"<think>   hi", "<think>\n\n", "각 \u1100\u1161\u11a8 가\u11a8", "\u1100\u1161", "x각y", "a word here", "words", "sword", "word_", "word.", "wordword",
	}
	texts = append(texts, corpus()[:300]...)
	checkAgainstHF(t, tok, filepath.Join(dir, "tokenizer.json"), texts)
}

// TestVariantBOSTemplate gives Llama 3 the TemplateProcessing post-processor
// of the current Meta release (the npm copy predates it): AddBOS must turn
// true, and BOS + Encode must equal HF's encode with add_special_tokens.
func TestVariantBOSTemplate(t *testing.T) {
	dir := writeVariant(t, "llama3", func(m map[string]any) {
		bos := map[string]any{"SpecialToken": map[string]any{"id": "<|begin_of_text|>", "type_id": 0}}
		seq := func(id string) map[string]any {
			return map[string]any{"Sequence": map[string]any{"id": id, "type_id": 0}}
		}
		m["post_processor"] = map[string]any{"type": "Sequence", "processors": []any{
			map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
			map[string]any{"type": "TemplateProcessing",
				"single":         []any{bos, seq("A")},
				"pair":           []any{bos, seq("A"), bos, seq("B")},
				"special_tokens": map[string]any{"<|begin_of_text|>": map[string]any{"id": "<|begin_of_text|>", "ids": []any{128000}, "tokens": []any{"<|begin_of_text|>"}}},
			},
		}}
	})
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !tok.AddBOS() {
		t.Fatal("AddBOS() = false with a TemplateProcessing that starts with <|begin_of_text|>")
	}
	if real := loadModel(t, "llama3"); real.AddBOS() {
		t.Error("AddBOS() = true for the npm Llama 3 file, whose post-processor is plain ByteLevel")
	}
	bosID, ok := tok.TokenID(tok.BOS())
	if !ok || bosID != 128000 {
		t.Fatalf("BOS %q -> %d, %v", tok.BOS(), bosID, ok)
	}
	texts := []string{"", "Hello", "<|begin_of_text|>x", " leading space"}
	reqs := make([]refRequest, len(texts))
	for i, s := range texts {
		reqs[i] = refRequest{Impl: "hf", Tokenizer: filepath.Join(dir, "tokenizer.json"), Text: s, Special: true}
	}
	res := reference(t).call(t, reqs)
	for i, s := range texts {
		got := append([]int32{bosID}, tok.Encode(s)...)
		if !equalIDs(got, res[i].IDs) {
			t.Errorf("%q: BOS+Encode = %v, HF with special tokens = %v", s, got, res[i].IDs)
		}
	}
}

func equalIDs(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
