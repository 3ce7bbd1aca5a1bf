package data

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func writeFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func openFake(t testing.TB, tok *fakeTok, tmpl Renderer, opts Options, srcs ...Source) *Dataset {
	t.Helper()
	d, err := open(srcs, tok, tmpl, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func all(t testing.TB, d *Dataset) []Sample {
	t.Helper()
	s, err := d.Range(context.Background(), 0, d.Len())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// maskedRuns returns the text of each maximal run of target tokens,
// decoded with decode (the fake tokenizer's here, a real one's in
// real_test.go).
func maskedRuns(s Sample, decode func([]int32) string) []string {
	var runs []string
	for t := 0; t < len(s.IDs); {
		if s.Mask[t] == 0 {
			t++
			continue
		}
		u := t
		for u < len(s.IDs) && s.Mask[u] == 1 {
			u++
		}
		runs = append(runs, decode(s.IDs[t:u]))
		t = u
	}
	return runs
}

// targets is maskedRuns with the fake tokenizer.
func targets(tok *fakeTok, s Sample) []string { return maskedRuns(s, tok.decode) }

func TestChatMaskCoversAssistantTurns(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "chat.jsonl", `{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"2+2?"},{"role":"assistant","content":"4"}]}`+"\n")
	for _, tc := range []struct {
		name string
		tmpl Renderer
		want []string
	}{
		// The trailing "\n" after <|im_end|> is not a target: the model stops
		// at <|im_end|>.
		{"chatml", chatML{}, []string{"Hello!<|im_end|>", "4<|im_end|>"}},
		// Only the last turn has a think block; the first turn must still be
		// found although rendering messages[:3] alone would add one.
		{"last-turn-thinks", lastTurnThinks{}, []string{"Hello!<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok := newFakeTok()
			d := openFake(t, tok, tc.tmpl, Options{}, Source{Path: p})
			s := all(t, d)[0]
			if got := targets(tok, s); !slices.Equal(got, tc.want) {
				t.Errorf("targets %q, want %q", got, tc.want)
			}
			full, _ := tc.tmpl.Render([]Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hi"}, {Role: "assistant", Content: "Hello!"}, {Role: "user", Content: "2+2?"}, {Role: "assistant", Content: "4"}}, false, nil)
			if got := tok.decode(s.IDs); got != full {
				t.Errorf("ids decode to %q, want the rendering %q", got, full)
			}
		})
	}
}

func TestChatTemplateBreakingPrefixProperty(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "chat.jsonl", `{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}]}`+"\n")
	d := openFake(t, newFakeTok(), countsTurns{}, Options{}, Source{Path: p})
	_, err := d.Range(context.Background(), 0, 1)
	if !errors.Is(err, ErrTemplate) || !strings.Contains(err.Error(), "chat.jsonl:1") || !strings.Contains(err.Error(), "prefix property") {
		t.Fatalf("got %v, want ErrTemplate naming chat.jsonl:1 and the prefix property", err)
	}
}

func TestPromptResponseAndText(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "mix.jsonl", `{"prompt":"Q: 1+1\n","response":"A: 2"}
{"text":"plain text"}
{"system":"S.","prompt":"P","response":"R"}
`)
	tok := newFakeTok()
	tok.bos, tok.addBOS = "<s>", true
	// Without a template: prompt then response, tokenized separately; EOS
	// closes the response and text; BOS is never a target.
	d := openFake(t, tok, nil, Options{}, Source{Path: p})
	s := all(t, d)
	want := []struct{ text, targets string }{
		{"<s>Q: 1+1\nA: 2</s>", "A: 2</s>"},
		{"<s>plain text</s>", "plain text</s>"},
		{"<s>S.PR</s>", "R</s>"},
	}
	for i, w := range want {
		if got := tok.decode(s[i].IDs); got != w.text {
			t.Errorf("sample %d = %q, want %q", i, got, w.text)
		}
		if got := strings.Join(targets(tok, s[i]), "|"); got != w.targets {
			t.Errorf("sample %d targets %q, want %q", i, got, w.targets)
		}
	}
	// With a template, prompt/response is a user/assistant chat.
	d = openFake(t, tok, chatML{}, Options{NoEOS: true}, Source{Path: p})
	s = all(t, d)
	if got := tok.decode(s[0].IDs); got != "<s><|im_start|>user\nQ: 1+1\n<|im_end|>\n<|im_start|>assistant\nA: 2<|im_end|>\n" {
		t.Errorf("templated prompt/response = %q", got)
	}
	if got := targets(tok, s[2]); !slices.Equal(got, []string{"R<|im_end|>"}) {
		t.Errorf("templated targets %q", got)
	}
	if got := tok.decode(s[1].IDs); got != "<s>plain text" {
		t.Errorf("NoEOS text = %q", got)
	}
}

func TestMaxLenPolicies(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "t.jsonl", `{"text":"abcdefgh"}
{"text":"abc"}
{"prompt":"long prompt here","response":"x"}
`)
	tok := newFakeTok()
	d := openFake(t, tok, nil, Options{MaxLen: 5, NoEOS: true}, Source{Path: p})
	s := all(t, d)
	if s[0].Status != Truncated || tok.decode(s[0].IDs) != "abcde" || len(s[0].Mask) != 5 {
		t.Errorf("truncate: %+v", s[0])
	}
	if s[1].Status != OK || tok.decode(s[1].IDs) != "abc" {
		t.Errorf("short sample: %+v", s[1])
	}
	if s[2].Status != Dropped || s[2].IDs != nil || !strings.Contains(s[2].Reason, "t.jsonl:3") {
		t.Errorf("no target after truncation must drop, naming the line: %+v", s[2])
	}
	st := d.Stats()
	if st.Samples != 3 || st.Truncated != 1 || st.Dropped != 1 || st.Reasons["no target within max-len"] != 1 || st.Tokens != 8 || st.Targets != 8 {
		t.Errorf("stats %+v", st)
	}

	d = openFake(t, tok, nil, Options{MaxLen: 5, Policy: Drop, NoEOS: true}, Source{Path: p})
	s = all(t, d)
	if s[0].Status != Dropped || s[0].IDs != nil || s[1].Status != OK || s[0].Index != 0 || s[1].Index != 1 {
		t.Errorf("drop: %+v %+v", s[0], s[1])
	}
	if st := d.Stats(); st.Dropped != 2 || st.Reasons["longer than max-len"] != 2 {
		t.Errorf("drop stats %+v", st)
	}
	if _, err := open([]Source{{Path: p}}, tok, nil, Options{Policy: "cut"}); !errors.Is(err, ErrOptions) {
		t.Errorf("bad policy: %v", err)
	}
}

// TestBadRecords checks every kind of bad input gives ErrBadRecord (or
// ErrTemplate) with file:line and the field, and that SkipBad counts it.
func TestBadRecords(t *testing.T) {
	good := `{"text":"ok"}`
	cases := []struct {
		name, line, want string
	}{
		{"malformed JSON", `{"text": "unterminated}`, "malformed JSON"},
		{"trailing data", `{"text":"a"} {"text":"b"}`, "malformed JSON"},
		{"not an object", `["text"]`, "want a JSON object"},
		{"missing fields", `{"body":"x"}`, "missing fields"},
		{"missing fields, null text", `{"body":"x","text":null}`, "missing fields: record has none of \"messages\", \"input_ids\", \"prompt\"/\"response\", \"text\" (its non-null keys: body)"},
		{"missing response", `{"prompt":"x"}`, "response: missing field"},
		{"empty response", `{"prompt":"x","response":"  "}`, "empty response"},
		{"empty text", `{"text":""}`, "empty text"},
		{"text not a string", `{"text":5}`, "text: wrong type"},
		{"unknown role", `{"messages":[{"role":"bot","content":"x"}]}`, "messages[0].role: unknown role"},
		{"missing role", `{"messages":[{"content":"x"}]}`, "messages[0].role: missing field"},
		{"empty conversation", `{"messages":[]}`, "empty conversation"},
		{"messages not a list", `{"messages":"hi"}`, "messages: wrong type"},
		{"no assistant", `{"messages":[{"role":"user","content":"x"}]}`, "no assistant turn"},
		{"empty assistant", `{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":""}]}`, "empty assistant turn"},
		{"invalid UTF-8", "{\"text\":\"a\xff\xfeb\"}", "invalid UTF-8"},
		{"id out of vocab", `{"input_ids":[1,2,99999]}`, "input_ids[2]: id out of vocab"},
		{"negative id", `{"input_ids":[-1]}`, "input_ids[0]: id out of vocab"},
		{"fractional id", `{"input_ids":[1.5]}`, "input_ids[0]: wrong type"},
		{"ids not a list", `{"input_ids":"1 2"}`, "input_ids: wrong type"},
		{"mask length", `{"input_ids":[1,2],"loss_mask":[1]}`, "loss_mask: length mismatch"},
		{"mask value", `{"input_ids":[1,2],"loss_mask":[1,2]}`, "loss_mask[1]: out of range"},
		{"mask all zero", `{"input_ids":[1,2],"loss_mask":[0,0]}`, "no targets"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := writeFile(t, dir, "bad.jsonl", good+"\n\n"+tc.line+"\n"+good+"\n")
			d := openFake(t, newFakeTok(), chatML{}, Options{}, Source{Path: p})
			_, err := d.Range(context.Background(), 0, d.Len())
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("got %v, want ErrBadRecord", err)
			}
			// Line 3: the blank line 2 is not a record but counts as a line.
			if !strings.Contains(err.Error(), "bad.jsonl:3: ") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q should name bad.jsonl:3 and say %q", err, tc.want)
			}
			d = openFake(t, newFakeTok(), chatML{}, Options{SkipBad: true}, Source{Path: p})
			s := all(t, d)
			if len(s) != 3 || s[1].Status != Skipped || s[0].Status != OK || s[2].Status != OK || !strings.Contains(s[1].Reason, tc.want) {
				t.Fatalf("SkipBad samples %+v", s)
			}
			if st := d.Stats(); st.Skipped != 1 || len(st.Examples) != 1 || st.Reasons[strings.SplitN(errReason(err), ":", 2)[0]] != 1 {
				t.Fatalf("stats %+v (reason of %v)", st, err)
			}
		})
	}
}

func errReason(err error) string {
	var re *RecordError
	if errors.As(err, &re) {
		return re.Reason
	}
	return ""
}

func TestSourceErrors(t *testing.T) {
	dir := t.TempDir()
	tok := newFakeTok()
	for _, tc := range []struct {
		name, file, content, want string
	}{
		{"empty jsonl", "e.jsonl", "\n \n", "no records"},
		{"unknown extension", "x.txt", "hi", "unknown extension"},
		{"compressed", "x.jsonl.gz", "hi", "decompress"},
		{"csv without rows", "h.csv", "text\n", "no data rows"},
		{"csv duplicate column", "d.csv", "text,text\na,b\n", "duplicate column"},
		{"csv broken quote", "q.csv", "text\n\"abc\n", "malformed CSV"},
		{"not parquet", "n.parquet", "PAR1 not really", "Parquet"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := writeFile(t, dir, tc.file, tc.content)
			_, err := open([]Source{{Path: p}}, tok, nil, Options{})
			if !errors.Is(err, ErrSource) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.file) {
				t.Fatalf("got %v, want ErrSource naming %s and %q", err, tc.file, tc.want)
			}
		})
	}
	missing := filepath.Join(dir, "missing.jsonl")
	if _, err := open([]Source{{Path: missing}}, tok, nil, Options{}); !errors.Is(err, ErrSource) || err.Error() != missing+" does not exist: check the path" {
		t.Errorf("missing file: %v", err)
	}
	// A directory is said to be one, with or without a format (it was
	// "unknown extension", or "read DIR: is a directory" with one).
	for _, format := range []string{"", "jsonl"} {
		if _, err := open([]Source{{Path: dir, Format: format}}, tok, nil, Options{}); !errors.Is(err, ErrSource) || !strings.HasPrefix(err.Error(), dir+" is a directory: give the dataset's files") {
			t.Errorf("a directory as a source (format %q): %v", format, err)
		}
	}
	p := writeFile(t, dir, "ok.jsonl", `{"text":"a"}`)
	if _, err := open([]Source{{Path: p, Weight: 1}, {Path: p}}, tok, nil, Options{}); !errors.Is(err, ErrOptions) {
		t.Errorf("mixed weights: %v", err)
	}
	if _, err := open([]Source{{Path: p, Weight: -1}}, tok, nil, Options{}); !errors.Is(err, ErrOptions) {
		t.Errorf("negative weight: %v", err)
	}
	d := openFake(t, tok, nil, Options{}, Source{Path: p})
	if _, err := d.Range(context.Background(), 0, 2); !errors.Is(err, ErrOptions) {
		t.Errorf("range past the end: %v", err)
	}
	// A chat record needs a template.
	p = writeFile(t, dir, "c.jsonl", `{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}]}`)
	d = openFake(t, tok, nil, Options{}, Source{Path: p})
	if _, err := d.Range(context.Background(), 0, 1); !errors.Is(err, ErrTemplate) || !strings.Contains(err.Error(), "c.jsonl:1") {
		t.Errorf("chat without template: %v", err)
	}
}

func TestPreTokenizedAndColumnMap(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "p.jsonl", `{"input_ids":[1,2,3],"loss_mask":[0,1,1]}
{"input_ids":[4,5]}
{"conversations":[{"from":"human","value":"q"},{"from":"gpt","value":"a"}]}
`)
	tok := newFakeTok()
	cols := ColumnMap{Messages: "conversations", Role: "from", Content: "value", Roles: map[string]string{"human": "user", "gpt": "assistant"}}
	d := openFake(t, tok, chatML{}, Options{}, Source{Path: p, Columns: cols})
	s := all(t, d)
	if got := s[0]; len(got.IDs) != 3 || got.IDs[2] != 3 || got.Mask[0] != 0 || got.Mask[1] != 1 {
		t.Errorf("pre-tokenized: %+v", got)
	}
	if got := s[1]; len(got.Mask) != 2 || got.Mask[0] != 1 || got.Mask[1] != 1 {
		t.Errorf("pre-tokenized without mask: %+v", got)
	}
	if got := targets(tok, s[2]); !slices.Equal(got, []string{"a<|im_end|>"}) {
		t.Errorf("ShareGPT columns: %q", got)
	}
}

func TestLineNumbersAndCRLF(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "l.jsonl", "\r\n{\"text\":\"a\"}\r\n\r\n\r\n  {\"text\":\"b\"}\r\n{\"text\":\"c\"}")
	d := openFake(t, newFakeTok(), nil, Options{NoEOS: true}, Source{Path: p})
	s := all(t, d)
	wantLoc := []string{":2", ":5", ":6"}
	wantText := []string{"a", "b", "c"}
	tok := newFakeTok()
	for i := range s {
		if !strings.HasSuffix(s[i].Loc, wantLoc[i]) || tok.decode(s[i].IDs) != wantText[i] {
			t.Errorf("record %d: loc %s text %q, want %s %q", i, s[i].Loc, tok.decode(s[i].IDs), wantLoc[i], wantText[i])
		}
	}
}

func TestCSV(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "d.csv", "\ufeffprompt,response,input_ids\n"+
		"\"multi\nline\",\"r1\",\n"+
		"p2,r2,\n"+
		",,\"[7,8]\"\n"+
		"p4\n")
	tok := newFakeTok()
	d := openFake(t, tok, nil, Options{NoEOS: true}, Source{Path: p})
	if d.Len() != 4 {
		t.Fatalf("Len %d, want 4", d.Len())
	}
	s, err := d.Range(context.Background(), 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	if tok.decode(s[0].IDs) != "multi\nliner1" || tok.decode(s[1].IDs) != "p2r2" || len(s[2].IDs) != 2 || s[2].IDs[0] != 7 {
		t.Errorf("csv samples %q %q %v", tok.decode(s[0].IDs), tok.decode(s[1].IDs), s[2].IDs)
	}
	if !strings.HasSuffix(s[0].Loc, "d.csv:2") || !strings.HasSuffix(s[1].Loc, "d.csv:4") || !strings.HasSuffix(s[2].Loc, "d.csv:5") {
		t.Errorf("csv locations %s %s %s", s[0].Loc, s[1].Loc, s[2].Loc)
	}
	_, err = d.Range(context.Background(), 3, 4)
	if !errors.Is(err, ErrBadRecord) || !strings.Contains(err.Error(), "d.csv:6") || !strings.Contains(err.Error(), "1 fields, the header has 3") {
		t.Errorf("short row: %v", err)
	}
}

func TestRangeParallelMatchesSequential(t *testing.T) {
	dir := t.TempDir()
	var b strings.Builder
	for i := 0; i < 500; i++ {
		if i%3 == 0 {
			b.WriteString(`{"messages":[{"role":"user","content":"q` + strings.Repeat("x", i%17) + `"},{"role":"assistant","content":"a` + strings.Repeat("y", i%13) + `"}]}` + "\n")
		} else {
			b.WriteString(`{"text":"t` + strings.Repeat("z", i%29) + `"}` + "\n")
		}
	}
	p := writeFile(t, dir, "m.jsonl", b.String())
	tok := newFakeTok()
	seq := all(t, openFake(t, tok, chatML{}, Options{Workers: 1}, Source{Path: p}))
	par := openFake(t, tok, chatML{}, Options{Workers: 4}, Source{Path: p})
	for _, r := range [][2]int64{{0, 500}, {17, 333}, {499, 500}, {5, 5}} {
		got, err := par.Range(context.Background(), r[0], r[1])
		if err != nil {
			t.Fatal(err)
		}
		for k, s := range got {
			w := seq[r[0]+int64(k)]
			if s.Index != w.Index || tok.decode(s.IDs) != tok.decode(w.IDs) || string(s.Mask) != string(w.Mask) {
				t.Fatalf("range %v: sample %d differs", r, s.Index)
			}
		}
	}
}

// TestUTF8BOM reads real files that start with a UTF-8 byte order mark
// (as Windows editors and Excel save them): the mark is not part of the
// first record or of the first column name, and line numbers are unchanged.
func TestUTF8BOM(t *testing.T) {
	tok := newFakeTok()
	for _, tc := range []struct {
		file string
		want []string
		locs []string
	}{
		{"bom.jsonl", []string{"hiyo", "second"}, []string{":1", ":2"}},
		{"bom.csv", []string{"hiyo", "qr"}, []string{":2", ":3"}},
	} {
		path := filepath.Join("testdata", tc.file)
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(string(b), "\ufeff") {
			t.Fatalf("%s does not start with a BOM", path)
		}
		d, err := open([]Source{{Path: path}}, tok, nil, Options{NoEOS: true})
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		defer d.Close()
		s, err := d.Range(context.Background(), 0, d.Len())
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		if len(s) != len(tc.want) {
			t.Fatalf("%s: %d samples, want %d", tc.file, len(s), len(tc.want))
		}
		for i := range s {
			if got := tok.decode(s[i].IDs); got != tc.want[i] || !strings.HasSuffix(s[i].Loc, tc.locs[i]) {
				t.Errorf("%s record %d: %q at %s, want %q at %s", tc.file, i, got, s[i].Loc, tc.want[i], tc.locs[i])
			}
		}
	}
}

// TestPretokenizedTakesOnlyInputIDs: a dataset opened with IDsOnly (no
// tokenizer: pre-tokenized) takes input_ids records only. A record with
// text instead became an empty sample (training went on without it, a
// fill failed on "no tokens", --skip-bad or not) without a word; it is now
// a bad record naming the file, the line and the fix, skipped and counted
// with SkipBad as other bad records are. Text beside the ids (a column
// HF's datasets.map kept) is not read: the record is its ids.
func TestPretokenizedTakesOnlyInputIDs(t *testing.T) {
	good := `{"input_ids":[1,2,3]}`
	ids := IDsOnly{Vocab: 64}
	for _, tc := range []struct {
		name, line, reason string
		want               []string
	}{
		{"text", `{"text":"hello"}`, "no input_ids", []string{`only text ("text")`, "needs input_ids in every record", "pretokenized: false"}},
		{"chat", `{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}]}`, "no input_ids", []string{`only text ("messages")`}},
		{"prompt/response", `{"prompt":"q","response":"a"}`, "no input_ids", []string{`only text ("prompt", "response")`}},
		{"nothing known", `{"body":"x","ids":[1]}`, "no input_ids", []string{"its non-null keys: body, ids", "columns.input_ids"}},
		{"id past the vocab", `{"input_ids":[1,64]}`, "id out of vocab", []string{"input_ids[1]: id out of vocab: token id 64 is outside [0, 64): the model the ids are read for has vocab_size 64"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := writeFile(t, t.TempDir(), "p.jsonl", good+"\n\n"+tc.line+"\n"+good+"\n")
			d, err := Open([]Source{{Path: p}}, ids, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			_, err = d.Range(context.Background(), 0, d.Len())
			if !errors.Is(err, ErrBadRecord) || errReason(err) != tc.reason || !strings.Contains(err.Error(), "p.jsonl:3: ") {
				t.Fatalf("got %v, want an ErrBadRecord %q naming p.jsonl:3", err, tc.reason)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			sd, err := Open([]Source{{Path: p}}, ids, Options{SkipBad: true})
			if err != nil {
				t.Fatal(err)
			}
			defer sd.Close()
			s := all(t, sd)
			if s[0].Status != OK || s[2].Status != OK || s[1].Status != Skipped || len(s[1].IDs) != 0 || !strings.Contains(s[1].Reason, "p.jsonl:3: ") {
				t.Fatalf("SkipBad samples %+v", s)
			}
			if st := sd.Stats(); st.Skipped != 1 || st.Reasons[tc.reason] != 1 || len(st.Examples) != 1 {
				t.Fatalf("SkipBad stats %+v, want one %q skipped", st, tc.reason)
			}
		})
	}

	// Null text columns are no text (Parquet rows of a mixed schema have
	// them); text beside the ids is not read, a chat's included; and with
	// a tokenizer, a record's input_ids are read beside a text field too.
	p := writeFile(t, t.TempDir(), "n.jsonl", `{"input_ids":[1,2],"text":null,"messages":null}`+"\n"+`{"input_ids":[4,5],"text":"hi"}`+"\n"+
		`{"input_ids":[6],"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}]}`+"\n")
	d, err := Open([]Source{{Path: p}}, ids, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if s := all(t, d); s[0].Status != OK || !slices.Equal(s[0].IDs, []int32{1, 2}) || s[1].Status != OK || !slices.Equal(s[1].IDs, []int32{4, 5}) ||
		s[2].Status != OK || !slices.Equal(s[2].IDs, []int32{6}) {
		t.Errorf("pre-tokenized records with null text, text or a chat beside their input_ids: %+v", s)
	}
	fd := openFake(t, newFakeTok(), nil, Options{}, Source{Path: writeFile(t, t.TempDir(), "t.jsonl", `{"input_ids":[1,2]}`+"\n"+`{"input_ids":[4,5],"text":"hi"}`+"\n")})
	if s := all(t, fd); !slices.Equal(s[1].IDs, []int32{4, 5}) {
		t.Errorf("with a tokenizer, input_ids beside text: %+v", s[1])
	}

	// Parquet names the row.
	pq := filepath.Join(t.TempDir(), "p.parquet")
	writeParquet(t, pq, [][][2]string{nil, nil, nil}, []*string{nil, sp("plain"), nil}, [][]int64{{1, 2}, nil, {3}}, 2)
	d, err = Open([]Source{{Path: pq}}, ids, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.Range(context.Background(), 0, d.Len()); !errors.Is(err, ErrBadRecord) || !strings.Contains(err.Error(), "p.parquet:row 1: no input_ids") {
		t.Errorf("Parquet text row: %v", err)
	}
}
