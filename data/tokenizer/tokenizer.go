package tokenizer

import (
	"fmt"
	"sync"
)

// Tokenizer is a loaded byte-level BPE tokenizer. It is safe for concurrent
// use: the only mutable state is the internal word cache, which is locked.
type Tokenizer struct {
	model   *bpe
	idToRaw []string // raw bytes of each vocab id
	inVocab []bool   // whether idToRaw[id] is a vocab entry
	merges  [][2]string

	nfc     bool
	pattern patternKind

	added       map[string]int32 // content -> id
	addedByID   map[int32]string
	addedList   []addedToken // by id
	rawMatcher  *matcher     // added tokens matched before normalization
	normMatcher *matcher     // added tokens with normalized=true

	templateBOS  string // first special token of TemplateProcessing's single template
	bos, eos     string
	cfgAddBOS    *bool
	cfgAddEOS    *bool
	chatTemplate string
	fingerprint  string
}

// encodeState carries the buffers of one Encode call. They are pooled so
// that the steady-state cost of a call is its output slices.
type encodeState struct {
	outer, inner []span
	ends         []int
	ids          []int32
}

var statePool = sync.Pool{New: func() any { return new(encodeState) }}

// Encode returns the token ids of text. Special and added tokens written in
// the text are matched (HF's default, which chat templates rely on); BOS is
// not added (see AddBOS). Invalid UTF-8 is tokenized as its raw bytes.
func (t *Tokenizer) Encode(text string) []int32 {
	ids, _ := t.encode(text, false)
	return ids
}

// EncodeOffsets is Encode plus, for each token, the byte range [start,end)
// of text it came from. A byte-level token that covers part of a multi-byte
// character gets exactly the bytes it covers. Where the normalizer changed
// the text (NFC composing "e\u0301"), each token made from the changed
// segment gets the whole original segment.
func (t *Tokenizer) EncodeOffsets(text string) (ids []int32, offsets [][2]int) {
	return t.encode(text, true)
}

func (t *Tokenizer) encode(text string, wantOffsets bool) ([]int32, [][2]int) {
	st := statePool.Get().(*encodeState)
	ids := make([]int32, 0, len(text)/3+4)
	var offs [][2]int
	if wantOffsets {
		offs = make([][2]int, 0, cap(ids))
	}
	st.outer = t.rawMatcher.split(text, st.outer[:0])
	for _, sp := range st.outer {
		if sp.tok >= 0 {
			ids = append(ids, t.rawMatcher.toks[sp.tok].ID)
			if wantOffsets {
				offs = append(offs, [2]int{sp.start, sp.end})
			}
			continue
		}
		piece := text[sp.start:sp.end]
		var align [][2]int
		if t.nfc {
			piece, align = normalizeNFC(piece)
		}
		st.inner = t.normMatcher.split(piece, st.inner[:0])
		for _, in := range st.inner {
			if in.tok >= 0 {
				ids = append(ids, t.normMatcher.toks[in.tok].ID)
				if wantOffsets {
					offs = append(offs, mapRange(sp.start, align, in.start, in.end))
				}
				continue
			}
			seg := piece[in.start:in.end]
			st.ends = splitPreTokens(t.pattern, seg, st.ends[:0])
			prev := 0
			for _, e := range st.ends {
				n0 := len(ids)
				ids = t.model.encodeWord(seg[prev:e], ids)
				if wantOffsets {
					pos := in.start + prev
					for _, id := range ids[n0:] {
						n := len(t.idToRaw[id])
						offs = append(offs, mapRange(sp.start, align, pos, pos+n))
						pos += n
					}
				}
				prev = e
			}
		}
	}
	statePool.Put(st)
	return ids, offs
}

// mapRange turns a byte range of a (possibly normalized) piece into a range
// of the original text; base is where the piece starts in the text.
func mapRange(base int, align [][2]int, a, b int) [2]int {
	if align == nil {
		return [2]int{base + a, base + b}
	}
	return [2]int{base + align[a][0], base + align[b-1][1]}
}

// Decode returns the text of ids: the exact inverse of Encode (up to the
// normalizer), so Decode(Encode(s)) == s for NFC text, and for any text
// with a tokenizer without a normalizer (Llama 3). Special tokens are not
// skipped. Unlike HF's decoder it does not replace bytes that are not valid
// UTF-8 with U+FFFD (a prefix of a token sequence may end inside a
// character; concatenating the decodes of the parts gives the whole). Ids
// outside the vocabulary are dropped, as HF does; DecodeStrict reports them.
func (t *Tokenizer) Decode(ids []int32) string {
	s, _ := t.decode(ids, false)
	return s
}

// DecodeStrict is Decode that fails on an id that is neither in the
// vocabulary nor an added token, naming its position.
func (t *Tokenizer) DecodeStrict(ids []int32) (string, error) {
	return t.decode(ids, true)
}

func (t *Tokenizer) decode(ids []int32, strict bool) (string, error) {
	n := 0
	for _, id := range ids {
		if id >= 0 && int(id) < len(t.idToRaw) {
			n += len(t.idToRaw[id])
		}
	}
	buf := make([]byte, 0, n)
	for i, id := range ids {
		if s, ok := t.addedByID[id]; ok {
			buf = append(buf, s...)
			continue
		}
		if id >= 0 && int(id) < len(t.idToRaw) && t.inVocab[id] {
			buf = append(buf, t.idToRaw[id]...)
			continue
		}
		if strict {
			return "", fmt.Errorf("%w: ids[%d] = %d (vocab size %d)", ErrUnknownID, i, id, t.VocabSize())
		}
	}
	return string(buf), nil
}

// VocabSize is the size of the id space: the largest id over the vocabulary
// and the added tokens, plus one. (A model's embedding may be larger.)
func (t *Tokenizer) VocabSize() int {
	n := len(t.idToRaw)
	for id := range t.addedByID {
		n = max(n, int(id)+1)
	}
	return n
}

// TokenID returns the id of a token written as in tokenizer.json (added
// token content, or a vocabulary entry in the byte-level alphabet: "Ġthe").
func (t *Tokenizer) TokenID(tok string) (int32, bool) {
	if id, ok := t.added[tok]; ok {
		return id, true
	}
	return t.vocabID(tok)
}

// Token returns the token of id as written in tokenizer.json.
func (t *Tokenizer) Token(id int32) (string, bool) {
	if s, ok := t.addedByID[id]; ok {
		return s, true
	}
	if id < 0 || int(id) >= len(t.idToRaw) || !t.inVocab[id] {
		return "", false
	}
	return byteLevelEncode(t.idToRaw[id]), true
}

// IsSpecial reports whether id is an added token marked special.
func (t *Tokenizer) IsSpecial(id int32) bool {
	for _, a := range t.addedList {
		if a.ID == id {
			return a.Special
		}
	}
	return false
}

// Fingerprint is the hex SHA-256 of the tokenizer's canonical content (see
// the package doc): equal for tokenizers that produce the same tokens and
// templates, whatever the JSON formatting.
func (t *Tokenizer) Fingerprint() string { return t.fingerprint }

// ChatTemplate is the Jinja chat template ("" if none).
func (t *Tokenizer) ChatTemplate() string { return t.chatTemplate }

// BOS is the bos_token of tokenizer_config.json ("" if none).
func (t *Tokenizer) BOS() string { return t.bos }

// EOS is the eos_token of tokenizer_config.json ("" if none).
func (t *Tokenizer) EOS() string { return t.eos }

// AddBOS reports whether the model expects BOS before a sequence: the
// config's add_bos_token when present (what transformers' Llama/Qwen
// tokenizers obey), otherwise whether tokenizer.json's TemplateProcessing
// puts a special token first. Encode never adds it.
func (t *Tokenizer) AddBOS() bool {
	if t.cfgAddBOS != nil {
		return *t.cfgAddBOS
	}
	return t.templateBOS != ""
}
