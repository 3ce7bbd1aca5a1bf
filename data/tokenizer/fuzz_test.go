package tokenizer

import (
	"path/filepath"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// FuzzEncode checks, for arbitrary input, that Encode round-trips through
// Decode (exactly for Llama 3, up to NFC for Qwen3), that offsets tile the
// text, and, for valid UTF-8, that ids equal HF tokenizers' (differential
// fuzzing against the node reference). The seeds run in every `go test`;
// `go test -fuzz FuzzEncode ./data/tokenizer` searches further.
func FuzzEncode(f *testing.F) {
	for _, s := range handCases {
		if len(s) < 400 {
			f.Add(s)
		}
	}
	f.Add("\xff\xfe invalid \xc3 utf8 \xe2\x82")
	f.Fuzz(func(t *testing.T, s string) {
		for _, name := range []string{"qwen3", "llama3"} {
			tok := loadModel(t, name)
			ids, offs := tok.EncodeOffsets(s)
			got := tok.Decode(ids)
			want := s
			if tok.nfc && utf8.ValidString(s) {
				want = norm.NFC.String(s)
			}
			if got != want && (utf8.ValidString(s) || !tok.nfc) {
				t.Fatalf("%s: Decode(Encode(%+q)) = %+q", name, s, got)
			}
			if !tok.nfc {
				prev := 0
				for i, o := range offs {
					if o[0] != prev || o[1] <= o[0] || s[o[0]:o[1]] != tok.Decode(ids[i:i+1]) {
						t.Fatalf("%s: %+q: token %d offsets %v break the tiling", name, s, i, o)
					}
					prev = o[1]
				}
				if prev != len(s) {
					t.Fatalf("%s: %+q: offsets end at %d of %d", name, s, prev, len(s))
				}
			}
			if !utf8.ValidString(s) {
				continue // HF tokenizers only takes valid UTF-8
			}
			res := reference(t).call(t, []refRequest{{Impl: "hf", Tokenizer: filepath.Join(modelDir(t, name), "tokenizer.json"), Text: s}})
			if msg := compareOne(tok, s, res[0]); msg != "" {
				t.Fatalf("%s: %+q: %s", name, s, msg)
			}
		}
	})
}
