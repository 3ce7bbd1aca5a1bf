package tokenizer

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"distill/internal/errkind"
)

// Sentinel errors; every error returned by Load wraps one of them.
var (
	// ErrUnsupported: tokenizer.json describes a component this package
	// does not implement (a model other than byte-level BPE, an unknown
	// normalizer, pre-tokenizer, regex, decoder or post-processor).
	ErrUnsupported = errors.New("tokenizer: unsupported tokenizer")
	// ErrInvalid: a file is missing, is not valid JSON, or is inconsistent
	// (a merge names a token that is not in the vocabulary, ...).
	ErrInvalid = errors.New("tokenizer: invalid tokenizer file")
	// ErrUnknownID: DecodeStrict was given an id that is neither in the
	// vocabulary nor an added token.
	ErrUnknownID = errors.New("tokenizer: unknown token id")
)

type fileJSON struct {
	AddedTokens   []addedToken    `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         modelJSON       `json:"model"`
}

type modelJSON struct {
	Type                    string          `json:"type"`
	Dropout                 *float64        `json:"dropout"`
	ContinuingSubwordPrefix *string         `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string         `json:"end_of_word_suffix"`
	ByteFallback            bool            `json:"byte_fallback"`
	IgnoreMerges            bool            `json:"ignore_merges"`
	Vocab                   json.RawMessage `json:"vocab"` // decoded once the type is known to be BPE
	Merges                  json.RawMessage `json:"merges"`
}

// component is the common shape of normalizers, pre-tokenizers, decoders and
// post-processors: a type tag plus the fields of the types we support.
type component struct {
	Type           string          `json:"type"`
	Normalizers    []component     `json:"normalizers"`
	Pretokenizers  []component     `json:"pretokenizers"`
	Processors     []component     `json:"processors"`
	Decoders       []component     `json:"decoders"`
	Pattern        json.RawMessage `json:"pattern"`
	Behavior       string          `json:"behavior"`
	Invert         bool            `json:"invert"`
	AddPrefixSpace bool            `json:"add_prefix_space"`
	UseRegex       *bool           `json:"use_regex"`
	Single         []struct {
		SpecialToken *struct {
			ID string `json:"id"`
		} `json:"SpecialToken"`
	} `json:"single"`
}

type configJSON struct {
	ChatTemplate json.RawMessage `json:"chat_template"`
	BOSToken     json.RawMessage `json:"bos_token"`
	EOSToken     json.RawMessage `json:"eos_token"`
	AddBOSToken  *bool           `json:"add_bos_token"`
	AddEOSToken  *bool           `json:"add_eos_token"`
}

// Load reads dir/tokenizer.json and dir/tokenizer_config.json (optional; a
// chat_template.jinja next to them, as newer transformers save, takes the
// place of the config's chat_template).
func Load(dir string) (*Tokenizer, error) {
	path := filepath.Join(dir, "tokenizer.json")
	raw, err := os.ReadFile(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		if st, serr := os.Stat(dir); serr != nil || !st.IsDir() {
			return nil, errkind.Errorf(ErrInvalid, "%s is not a directory: give the directory that holds the tokenizer's tokenizer.json (an HF model or tokenizer directory)", dir)
		}
		return nil, errkind.Errorf(ErrInvalid, "%s has no tokenizer.json: give the directory that holds the tokenizer's tokenizer.json (an HF model or tokenizer directory)", dir)
	case err != nil:
		return nil, fmt.Errorf("%w: %v (expected an HF tokenizer directory)", ErrInvalid, err)
	}
	var cfgRaw []byte
	cfgPath := filepath.Join(dir, "tokenizer_config.json")
	if b, err := os.ReadFile(cfgPath); err == nil {
		cfgRaw = b
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	var tmplFile []byte
	if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
		tmplFile = b
	}
	t, err := parse(raw, path)
	if err != nil {
		return nil, err
	}
	if err := t.parseConfig(cfgRaw, cfgPath, tmplFile); err != nil {
		return nil, err
	}
	t.fingerprint = t.computeFingerprint()
	return t, nil
}

// parse builds a Tokenizer from the bytes of a tokenizer.json; path names it
// in errors.
func parse(raw []byte, path string) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(raw, &f); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrInvalid, path, jsonErr(raw, err))
	}
	t := &Tokenizer{}
	if err := t.parseModel(&f.Model, path); err != nil {
		return nil, err
	}
	var err error
	if t.nfc, err = parseNormalizer(f.Normalizer, path); err != nil {
		return nil, err
	}
	if t.pattern, err = parsePreTokenizer(f.PreTokenizer, path); err != nil {
		return nil, err
	}
	if err := parseDecoder(f.Decoder, path); err != nil {
		return nil, err
	}
	if t.templateBOS, err = parsePostProcessor(f.PostProcessor, path); err != nil {
		return nil, err
	}
	t.parseAdded(f.AddedTokens)
	return t, nil
}

// jsonErr adds line:column to a syntax error so a hand-edited file can be fixed.
func jsonErr(raw []byte, err error) string {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	off := int64(-1)
	if errors.As(err, &se) {
		off = se.Offset
	} else if errors.As(err, &te) {
		off = te.Offset
	}
	if off < 0 || off > int64(len(raw)) {
		return err.Error()
	}
	line := 1 + bytes.Count(raw[:off], []byte("\n"))
	col := off - int64(bytes.LastIndexByte(raw[:off], '\n'))
	return fmt.Sprintf("line %d column %d: %v", line, col, err)
}

func (t *Tokenizer) parseModel(m *modelJSON, path string) error {
	if m.Type != "BPE" {
		if m.Type == "" {
			return fmt.Errorf("%w: %s: model.type is missing", ErrInvalid, path)
		}
		return fmt.Errorf("%w: %s: model type %q (only byte-level BPE is supported)", ErrUnsupported, path, m.Type)
	}
	if m.Dropout != nil && *m.Dropout != 0 {
		return fmt.Errorf("%w: %s: BPE dropout %v (only deterministic BPE is supported)", ErrUnsupported, path, *m.Dropout)
	}
	if m.ByteFallback {
		return fmt.Errorf("%w: %s: BPE with byte_fallback (a SentencePiece-style BPE, not byte-level)", ErrUnsupported, path)
	}
	if m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "" {
		return fmt.Errorf("%w: %s: BPE continuing_subword_prefix %q", ErrUnsupported, path, *m.ContinuingSubwordPrefix)
	}
	if m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "" {
		return fmt.Errorf("%w: %s: BPE end_of_word_suffix %q", ErrUnsupported, path, *m.EndOfWordSuffix)
	}
	var vocab map[string]int32
	if err := json.Unmarshal(m.Vocab, &vocab); err != nil {
		return fmt.Errorf("%w: %s: model.vocab: %v (want an object of token: id)", ErrInvalid, path, err)
	}
	if len(vocab) == 0 {
		return fmt.Errorf("%w: %s: model.vocab is empty or missing", ErrInvalid, path)
	}
	b := &bpe{vocab: make(map[string]int32, len(vocab)), ignoreMerges: m.IgnoreMerges}
	b.cache.init()
	maxID := int32(-1)
	for tok, id := range vocab {
		if id < 0 {
			return fmt.Errorf("%w: %s: vocab token %q has negative id %d", ErrInvalid, path, tok, id)
		}
		rawTok, ok := byteLevelDecode(tok)
		if !ok {
			return fmt.Errorf("%w: %s: vocab token %q (id %d) is not in the byte-level alphabet: not a byte-level BPE", ErrUnsupported, path, tok, id)
		}
		b.vocab[rawTok] = id
		maxID = max(maxID, id)
	}
	t.idToRaw = make([]string, maxID+1)
	t.inVocab = make([]bool, maxID+1)
	for rawTok, id := range b.vocab {
		if t.inVocab[id] {
			return fmt.Errorf("%w: %s: vocab id %d is used by two tokens (%q and %q)", ErrInvalid, path, id, byteLevelEncode(t.idToRaw[id]), byteLevelEncode(rawTok))
		}
		t.idToRaw[id], t.inVocab[id] = rawTok, true
	}
	for c := 0; c < 256; c++ {
		id, ok := b.vocab[string([]byte{byte(c)})]
		if !ok {
			return fmt.Errorf("%w: %s: vocab lacks the byte-level token %q for byte 0x%02X", ErrInvalid, path, string(byteToRune[c]), c)
		}
		b.byteID[c] = id
	}
	pairs, err := parseMerges(m.Merges, path)
	if err != nil {
		return err
	}
	b.merges = make(map[uint64]uint64, len(pairs))
	for rank, p := range pairs {
		var ids [2]int32
		for k, s := range p {
			r, ok := byteLevelDecode(s)
			id, in := b.vocab[r]
			if !ok || !in {
				return fmt.Errorf("%w: %s: merge %d (%q %q): token %q is not in the vocab", ErrInvalid, path, rank, p[0], p[1], s)
			}
			ids[k] = id
		}
		merged := t.idToRaw[ids[0]] + t.idToRaw[ids[1]]
		newID, ok := b.vocab[merged]
		if !ok {
			return fmt.Errorf("%w: %s: merge %d (%q %q): result %q is not in the vocab", ErrInvalid, path, rank, p[0], p[1], p[0]+p[1])
		}
		// Like HF, a repeated pair keeps its last rank.
		b.merges[pairKey(ids[0], ids[1])] = uint64(rank)<<32 | uint64(uint32(newID))
	}
	t.merges = pairs
	t.model = b
	return nil
}

// parseMerges accepts both serializations: ["a b", ...] (tokenizers < 0.20)
// and [["a", "b"], ...].
func parseMerges(raw json.RawMessage, path string) ([][2]string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	inner := bytes.TrimSpace(bytes.TrimPrefix(raw, []byte("[")))
	if len(inner) > 0 && inner[0] == '[' {
		var pairs [][2]string
		if err := json.Unmarshal(raw, &pairs); err != nil {
			return nil, fmt.Errorf("%w: %s: model.merges: %v", ErrInvalid, path, err)
		}
		return pairs, nil
	}
	var lines []string
	if err := json.Unmarshal(raw, &lines); err != nil {
		return nil, fmt.Errorf("%w: %s: model.merges: %v", ErrInvalid, path, err)
	}
	pairs := make([][2]string, len(lines))
	for i, l := range lines {
		a, b, ok := cutSpace(l)
		if !ok {
			return nil, fmt.Errorf("%w: %s: merge %d %q is not two tokens separated by one space", ErrInvalid, path, i, l)
		}
		pairs[i] = [2]string{a, b}
	}
	return pairs, nil
}

func cutSpace(l string) (string, string, bool) {
	for i := 0; i < len(l); i++ {
		if l[i] == ' ' {
			a, b := l[:i], l[i+1:]
			for j := 0; j < len(b); j++ {
				if b[j] == ' ' {
					return "", "", false
				}
			}
			return a, b, a != "" && b != ""
		}
	}
	return "", "", false
}

func isNull(raw json.RawMessage) bool {
	s := bytes.TrimSpace(raw)
	return len(s) == 0 || string(s) == "null"
}

func parseNormalizer(raw json.RawMessage, path string) (nfc bool, err error) {
	if isNull(raw) {
		return false, nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return false, fmt.Errorf("%w: %s: normalizer: %v", ErrInvalid, path, err)
	}
	var walk func(c component) error
	walk = func(c component) error {
		switch c.Type {
		case "NFC":
			nfc = true
		case "Sequence":
			for _, n := range c.Normalizers {
				if err := walk(n); err != nil {
					return err
				}
			}
		default:
			return fmt.Errorf("%w: %s: normalizer %q (supported: NFC, Sequence of NFC, none)", ErrUnsupported, path, c.Type)
		}
		return nil
	}
	return nfc, walk(c)
}

func parsePreTokenizer(raw json.RawMessage, path string) (patternKind, error) {
	if isNull(raw) {
		return 0, fmt.Errorf("%w: %s: no pre_tokenizer (a byte-level BPE needs ByteLevel)", ErrUnsupported, path)
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return 0, fmt.Errorf("%w: %s: pre_tokenizer: %v", ErrInvalid, path, err)
	}
	steps := []component{c}
	if c.Type == "Sequence" {
		steps = c.Pretokenizers
	}
	var kind patternKind
	sawByteLevel := false
	for i, s := range steps {
		switch s.Type {
		case "Split":
			if kind != 0 || sawByteLevel {
				return 0, fmt.Errorf("%w: %s: pre_tokenizer step %d: Split must come once, before ByteLevel", ErrUnsupported, path, i)
			}
			var pat struct {
				Regex  *string `json:"Regex"`
				String *string `json:"String"`
			}
			if err := json.Unmarshal(s.Pattern, &pat); err != nil || pat.Regex == nil {
				return 0, fmt.Errorf("%w: %s: pre_tokenizer Split pattern %s (only the known Regex patterns are supported)", ErrUnsupported, path, string(s.Pattern))
			}
			switch *pat.Regex {
			case regexQwen2:
				kind = patQwen2
			case regexLlama3:
				kind = patLlama3
			case regexGPT2:
				kind = patGPT2
			default:
				return 0, fmt.Errorf("%w: %s: pre_tokenizer Split regex %q is not one of the known patterns (Qwen2/3, Llama 3, GPT-2); it needs its own scanner", ErrUnsupported, path, *pat.Regex)
			}
			if s.Behavior != "Isolated" || s.Invert {
				return 0, fmt.Errorf("%w: %s: pre_tokenizer Split behavior %q invert=%v (only Isolated, invert=false)", ErrUnsupported, path, s.Behavior, s.Invert)
			}
		case "ByteLevel":
			if sawByteLevel || i != len(steps)-1 {
				return 0, fmt.Errorf("%w: %s: pre_tokenizer step %d: ByteLevel must be the last step", ErrUnsupported, path, i)
			}
			sawByteLevel = true
			if s.AddPrefixSpace {
				return 0, fmt.Errorf("%w: %s: pre_tokenizer ByteLevel add_prefix_space=true", ErrUnsupported, path)
			}
			useRegex := s.UseRegex == nil || *s.UseRegex
			switch {
			case useRegex && kind != 0:
				return 0, fmt.Errorf("%w: %s: pre_tokenizer ByteLevel use_regex=true after a Split", ErrUnsupported, path)
			case useRegex:
				kind = patGPT2
			case kind == 0:
				return 0, fmt.Errorf("%w: %s: pre_tokenizer ByteLevel use_regex=false without a Split (no pre-tokenization)", ErrUnsupported, path)
			}
		default:
			return 0, fmt.Errorf("%w: %s: pre_tokenizer %q (supported: Split with a known regex, ByteLevel)", ErrUnsupported, path, s.Type)
		}
	}
	if !sawByteLevel {
		return 0, fmt.Errorf("%w: %s: pre_tokenizer has no ByteLevel step: not a byte-level BPE", ErrUnsupported, path)
	}
	return kind, nil
}

func parseDecoder(raw json.RawMessage, path string) error {
	if isNull(raw) {
		return fmt.Errorf("%w: %s: no decoder (a byte-level BPE needs the ByteLevel decoder)", ErrUnsupported, path)
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("%w: %s: decoder: %v", ErrInvalid, path, err)
	}
	if c.Type == "Sequence" && len(c.Decoders) == 1 {
		c = c.Decoders[0]
	}
	if c.Type != "ByteLevel" {
		return fmt.Errorf("%w: %s: decoder %q (only ByteLevel)", ErrUnsupported, path, c.Type)
	}
	return nil
}

// parsePostProcessor returns the token a TemplateProcessing puts first in a
// single sequence ("" if none): how HF fast tokenizers add BOS.
func parsePostProcessor(raw json.RawMessage, path string) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return "", fmt.Errorf("%w: %s: post_processor: %v", ErrInvalid, path, err)
	}
	var first string
	var walk func(c component) error
	walk = func(c component) error {
		switch c.Type {
		case "ByteLevel":
		case "Sequence":
			for _, p := range c.Processors {
				if err := walk(p); err != nil {
					return err
				}
			}
		case "TemplateProcessing":
			if len(c.Single) > 0 && c.Single[0].SpecialToken != nil {
				first = c.Single[0].SpecialToken.ID
			}
		default:
			return fmt.Errorf("%w: %s: post_processor %q (supported: ByteLevel, TemplateProcessing, Sequence)", ErrUnsupported, path, c.Type)
		}
		return nil
	}
	return first, walk(c)
}

// parseAdded registers the added tokens the way HF tokenizers does when it
// reads tokenizer.json: the ids written in the file are not used (HF only
// warns when they disagree); a token whose content is already known keeps
// that id (an earlier added token, then the model vocabulary), any other
// gets the next free id after the vocabulary. For the files of real models
// both agree. Empty contents are ignored, as in HF.
func (t *Tokenizer) parseAdded(toks []addedToken) {
	t.added = make(map[string]int32, len(toks))
	t.addedByID = make(map[int32]string, len(toks))
	byID := map[int32]addedToken{}
	nextID := int32(len(t.model.vocab)) // HF: model.get_vocab_size(), the number of entries
	for _, a := range toks {
		if a.Content == "" {
			continue
		}
		if id, ok := t.added[a.Content]; ok {
			a.ID = id
		} else if id, ok := t.vocabID(a.Content); ok {
			a.ID = id
		} else {
			a.ID = nextID
			nextID++
		}
		t.added[a.Content] = a.ID
		byID[a.ID] = a
	}
	var rawToks, normToks []addedToken
	var rawPat, normPat []string
	for _, a := range byID {
		t.addedList = append(t.addedList, a)
	}
	sort.Slice(t.addedList, func(i, j int) bool { return t.addedList[i].ID < t.addedList[j].ID })
	for _, a := range t.addedList {
		content := a.Content
		if a.Normalized {
			if t.nfc {
				content, _ = normalizeNFC(content)
			}
			normToks, normPat = append(normToks, a), append(normPat, content)
		} else {
			rawToks, rawPat = append(rawToks, a), append(rawPat, content)
		}
		// Decode gives what HF's decoder is handed: the normalized form.
		t.addedByID[a.ID] = content
	}
	t.rawMatcher = newMatcher(rawToks, rawPat)
	t.normMatcher = newMatcher(normToks, normPat)
}

// vocabID looks a token up in the model vocabulary by its byte-level form.
func (t *Tokenizer) vocabID(tok string) (int32, bool) {
	raw, ok := byteLevelDecode(tok)
	if !ok {
		return 0, false
	}
	id, ok := t.model.vocab[raw]
	return id, ok
}

// tokenString reads bos_token/eos_token: a string, an AddedToken object
// ({"content": ...}) or null.
func tokenString(raw json.RawMessage, field, path string) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var obj struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Content == nil {
		return "", fmt.Errorf("%w: %s: %s is %s (want a string or an object with \"content\")", ErrInvalid, path, field, string(raw))
	}
	return *obj.Content, nil
}

func (t *Tokenizer) parseConfig(raw []byte, path string, tmplFile []byte) error {
	if raw != nil {
		var c configJSON
		if err := json.Unmarshal(raw, &c); err != nil {
			return fmt.Errorf("%w: %s: %v", ErrInvalid, path, jsonErr(raw, err))
		}
		var err error
		if t.bos, err = tokenString(c.BOSToken, "bos_token", path); err != nil {
			return err
		}
		if t.eos, err = tokenString(c.EOSToken, "eos_token", path); err != nil {
			return err
		}
		t.cfgAddBOS, t.cfgAddEOS = c.AddBOSToken, c.AddEOSToken
		if !isNull(c.ChatTemplate) {
			var s string
			if err := json.Unmarshal(c.ChatTemplate, &s); err == nil {
				t.chatTemplate = s
			} else {
				var named []struct {
					Name     string `json:"name"`
					Template string `json:"template"`
				}
				if err := json.Unmarshal(c.ChatTemplate, &named); err != nil {
					return fmt.Errorf("%w: %s: chat_template is neither a string nor a list of {name, template}", ErrInvalid, path)
				}
				for _, n := range named {
					if n.Name == "default" {
						t.chatTemplate = n.Template
					}
				}
			}
		}
	}
	if tmplFile != nil {
		t.chatTemplate = string(tmplFile)
	}
	return nil
}

// computeFingerprint hashes the canonical content described in the package
// doc. Its byte layout is a format: changing it changes every fingerprint
// recorded in caches, so it carries a version string.
func (t *Tokenizer) computeFingerprint() string {
	h := sha256.New()
	var buf []byte
	str := func(s string) {
		buf = binary.AppendUvarint(buf, uint64(len(s)))
		buf = append(buf, s...)
	}
	num := func(v uint64) { buf = binary.AppendUvarint(buf, v) }
	flag := func(b bool) {
		if b {
			num(1)
		} else {
			num(0)
		}
	}
	flush := func() {
		if len(buf) > 1<<16 {
			h.Write(buf)
			buf = buf[:0]
		}
	}
	str("distill/tokenizer fingerprint v1")
	flag(t.nfc)
	str(t.pattern.String())
	flag(t.model.ignoreMerges)
	num(uint64(len(t.idToRaw)))
	for id, r := range t.idToRaw {
		if t.inVocab[id] {
			num(uint64(id))
			str(r)
			flush()
		}
	}
	num(uint64(len(t.merges)))
	for _, p := range t.merges {
		str(p[0])
		str(p[1])
		flush()
	}
	num(uint64(len(t.addedList)))
	for _, a := range t.addedList {
		num(uint64(a.ID))
		str(a.Content)
		flag(a.SingleWord)
		flag(a.LStrip)
		flag(a.RStrip)
		flag(a.Normalized)
		flag(a.Special)
	}
	str(t.templateBOS)
	str(t.bos)
	str(t.eos)
	flag(t.AddBOS())
	flag(t.cfgAddEOS != nil && *t.cfgAddEOS)
	str(t.chatTemplate)
	h.Write(buf)
	return hex.EncodeToString(h.Sum(nil))
}
