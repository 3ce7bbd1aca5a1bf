package tokenizer

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestSplitHandDerived pins the scanners to splits derived by hand from the
// regexes (independently of any implementation), including the cases where
// Oniguruma's backtracking matters.
func TestSplitHandDerived(t *testing.T) {
	cases := []struct {
		kind patternKind
		in   string
		want []string
	}{
		// \s*[\r\n]+ backtracks to the last newline; \s+(?!\S) leaves one space for " 1"? No:
		// " 1" is not a match of A2 (1 is not a letter), so the lone space is \s+.
		{patQwen2, "Hello world  \n\n 12345", []string{"Hello", " world", "  \n\n", " ", "1", "2", "3", "4", "5"}},
		{patLlama3, "Hello world  \n\n 12345", []string{"Hello", " world", "  \n\n", " ", "123", "45"}},
		{patQwen2, "a   b", []string{"a", "  ", " b"}},   // \s+(?!\S) gives back the last space
		{patQwen2, "a   ", []string{"a", "   "}},         // at the end (?!\S) holds
		{patQwen2, "a \tb", []string{"a", " ", "\tb"}},   // [^\r\n\p{L}\p{N}]? takes the tab
		{patQwen2, "a \n b", []string{"a", " \n", " b"}}, // \s*[\r\n]+
		{patQwen2, "x!!\r\n\ny", []string{"x", "!!\r\n\n", "y"}},
		{patQwen2, " !?", []string{" !?"}},
		{patQwen2, "  !?", []string{" ", " !?"}},
		{patQwen2, "don't", []string{"don", "'t"}},
		{patQwen2, "DON'T", []string{"DON", "'T"}},
		{patQwen2, "x'ſa", []string{"x", "'ſ", "a"}},  // (?i) folds ſ to s
		{patGPT2, "DON'T", []string{"DON", "'", "T"}}, // GPT-2's contractions are case-sensitive
		{patQwen2, "'abc", []string{"'abc"}},
		{patQwen2, "a\u0085b", []string{"a", "\u0085b"}}, // NEL is \s but not [\r\n]
		{patQwen2, "a \ufeffb", []string{"a", " \ufeff", "b"}},
		{patQwen2, "\u3000\u3000漢", []string{"\u3000", "\u3000漢"}},
		{patGPT2, "a  1234 !!", []string{"a", " ", " 1234", " !!"}},
		{patQwen2, "", nil},
	}
	for _, c := range cases {
		got := pieces(c.in, splitPreTokens(c.kind, c.in, nil))
		if !slices.Equal(got, c.want) {
			t.Errorf("%v %+q: got %+q want %+q", c.kind, c.in, got, c.want)
		}
	}
}

// TestMergeOrder checks BPE on a toy vocabulary where the result depends on
// merge priority: with merges (b c) before (a b), "abc" is a + bc, and with
// the repeated pair "aaaa" merges left to right.
func TestMergeOrder(t *testing.T) {
	dir := toyDir(t, `[["b","c"],["a","b"],["a","a"],["aa","aa"]]`)
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"abc", []string{"a", "bc"}},
		{"ab", []string{"ab"}},
		{"aaaa", []string{"aaaa"}},
		{"aaa", []string{"aa", "a"}},
		{"aaaaa", []string{"aaaa", "a"}},
	} {
		var got []string
		for _, id := range tok.Encode(c.in) {
			s, _ := tok.Token(id)
			got = append(got, s)
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%q: got %q want %q", c.in, got, c.want)
		}
	}
}

// toyDir writes a byte-level BPE tokenizer.json with the 256 byte tokens
// (ids 0..255), the given merges and the tokens bc, ab, aa, aaaa.
func toyDir(t *testing.T, merges string) string {
	t.Helper()
	var vocab strings.Builder
	vocab.WriteString("{")
	for b := 0; b < 256; b++ {
		if b > 0 {
			vocab.WriteString(",")
		}
		vocab.WriteString(quote(string(byteToRune[b])) + ":" + itoa(b))
	}
	for i, m := range []string{"bc", "ab", "aa", "aaaa"} {
		vocab.WriteString("," + quote(m) + ":" + itoa(256+i))
	}
	vocab.WriteString("}")
	js := `{"version":"1.0","added_tokens":[],"normalizer":null,
"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true},
"post_processor":null,"decoder":{"type":"ByteLevel"},
"model":{"type":"BPE","vocab":` + vocab.String() + `,"merges":` + merges + `}}`
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), []byte(js), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func quote(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

func itoa(i int) string { return strconv.Itoa(i) }

// TestLoadErrors feeds broken and unsupported files; each error must wrap
// the right sentinel and name the problem.
func TestLoadErrors(t *testing.T) {
	good := func() string {
		b, err := os.ReadFile(filepath.Join(toyDir(t, `[["a","b"]]`), "tokenizer.json"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}()
	cases := []struct {
		name     string
		json     string
		sentinel error
		mention  string
	}{
		{"malformed", `{"model": {"type": "BPE",}`, ErrInvalid, "line 1"},
		{"wordpiece", `{"model":{"type":"WordPiece","vocab":{"a":0}}}`, ErrUnsupported, `"WordPiece"`},
		{"unigram", `{"model":{"type":"Unigram","vocab":[["a",0]]}}`, ErrUnsupported, `"Unigram"`},
		{"byte fallback", strings.Replace(good, `"type":"BPE",`, `"type":"BPE","byte_fallback":true,`, 1), ErrUnsupported, "byte_fallback"},
		{"sentencepiece vocab", strings.Replace(good, `"model":{"type":"BPE","vocab":{`, `"model":{"type":"BPE","vocab":{"▁the":999,`, 1), ErrUnsupported, "▁the"},
		{"normalizer", strings.Replace(good, `"normalizer":null`, `"normalizer":{"type":"Lowercase"}`, 1), ErrUnsupported, `normalizer "Lowercase"`},
		{"pretokenizer", strings.Replace(good, `"pre_tokenizer":{"type":"ByteLevel"`, `"pre_tokenizer":{"type":"Whitespace"`, 1), ErrUnsupported, `"Whitespace"`},
		{"regex", strings.Replace(good, `"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true}`,
			`"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\s+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","use_regex":false}]}`, 1), ErrUnsupported, `regex "\\s+"`},
		{"decoder", strings.Replace(good, `"decoder":{"type":"ByteLevel"}`, `"decoder":{"type":"WordPiece"}`, 1), ErrUnsupported, `decoder "WordPiece"`},
		{"merge oov", strings.Replace(good, `"merges":[["a","b"]]`, `"merges":[["a","zz"]]`, 1), ErrInvalid, `"zz" is not in the vocab`},
		{"merge result oov", strings.Replace(good, `"merges":[["a","b"]]`, `"merges":[["x","y"]]`, 1), ErrInvalid, `result "xy"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), []byte(c.json), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := Load(dir)
			if err == nil {
				t.Fatal("Load succeeded")
			}
			if !errors.Is(err, c.sentinel) {
				t.Errorf("error %v does not wrap %v", err, c.sentinel)
			}
			if !strings.Contains(err.Error(), c.mention) || !strings.Contains(err.Error(), "tokenizer.json") {
				t.Errorf("error %q should name %q and the file", err, c.mention)
			}
		})
	}
	// A directory without tokenizer.json, or no directory at all, is said
	// as such (it was "tokenizer: invalid tokenizer file: open
	// DIR/tokenizer.json: no such file or directory").
	empty := t.TempDir()
	if _, err := Load(empty); !errors.Is(err, ErrInvalid) || err.Error() != empty+" has no tokenizer.json: give the directory that holds the tokenizer's tokenizer.json (an HF model or tokenizer directory)" {
		t.Errorf("missing file: %v", err)
	}
	nope := filepath.Join(empty, "nope")
	if _, err := Load(nope); !errors.Is(err, ErrInvalid) || !strings.HasPrefix(err.Error(), nope+" is not a directory: give the directory") {
		t.Errorf("missing directory: %v", err)
	}
}

func TestAccessors(t *testing.T) {
	q := loadModel(t, "qwen3")
	l := loadModel(t, "llama3")
	if q.VocabSize() != 151669 || l.VocabSize() != 128256 {
		t.Errorf("VocabSize qwen3 %d llama3 %d, want 151669 128256", q.VocabSize(), l.VocabSize())
	}
	if q.EOS() != "<|im_end|>" || q.BOS() != "" || q.AddBOS() {
		t.Errorf("qwen3 EOS %q BOS %q AddBOS %v", q.EOS(), q.BOS(), q.AddBOS())
	}
	if l.BOS() != "<|begin_of_text|>" || l.EOS() != "<|end_of_text|>" {
		t.Errorf("llama3 BOS %q EOS %q", l.BOS(), l.EOS())
	}
	if !strings.Contains(q.ChatTemplate(), "<|im_start|>") || !strings.Contains(l.ChatTemplate(), "<|start_header_id|>") {
		t.Error("chat templates not loaded")
	}
	if id, ok := q.TokenID("<|im_end|>"); !ok || id != 151645 {
		t.Errorf("TokenID(<|im_end|>) = %d, %v", id, ok)
	}
	if id, ok := q.TokenID("Ġworld"); !ok || id != 1879 {
		t.Errorf("TokenID(Ġworld) = %d, %v", id, ok)
	}
	if s, ok := q.Token(1879); !ok || s != "Ġworld" {
		t.Errorf("Token(1879) = %q", s)
	}
	if _, ok := q.Token(-1); ok {
		t.Error("Token(-1) ok")
	}
	if _, err := q.DecodeStrict([]int32{1879, 999999}); !errors.Is(err, ErrUnknownID) || !strings.Contains(err.Error(), "ids[1]") {
		t.Errorf("DecodeStrict: %v", err)
	}
	if q.Fingerprint() == l.Fingerprint() || len(q.Fingerprint()) != 64 {
		t.Errorf("fingerprints %s %s", q.Fingerprint(), l.Fingerprint())
	}
}

// TestFingerprintCanonical: reformatting tokenizer.json (key order,
// indentation) keeps the fingerprint; changing a merge or the template
// changes it.
func TestFingerprintCanonical(t *testing.T) {
	base := loadModel(t, "qwen3").Fingerprint()
	same := writeVariant(t, "qwen3", func(m map[string]any) {})
	if tok, err := Load(same); err != nil || tok.Fingerprint() != base {
		t.Errorf("re-serialized file: fingerprint %v (err %v), want %s", tok.Fingerprint(), err, base)
	}
	diff := writeVariant(t, "qwen3", func(m map[string]any) {
		merges := m["model"].(map[string]any)["merges"].([]any)
		merges[10], merges[11] = merges[11], merges[10]
	})
	if tok, err := Load(diff); err != nil || tok.Fingerprint() == base {
		t.Errorf("swapped merges: fingerprint unchanged (err %v)", err)
	}
	tmpl := writeVariant(t, "qwen3", func(m map[string]any) {})
	if err := os.WriteFile(filepath.Join(tmpl, "chat_template.jinja"), []byte("{{ messages }}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if tok, err := Load(tmpl); err != nil || tok.Fingerprint() == base || tok.ChatTemplate() != "{{ messages }}" {
		t.Errorf("chat_template.jinja: not used or fingerprint unchanged (err %v)", err)
	}
}
