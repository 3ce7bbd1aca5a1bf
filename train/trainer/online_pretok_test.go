package trainer

import (
	"bytes"
	"errors"
	"io"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"distill/cache"
)

// writePretokenized writes n pre-tokenized records ({"input_ids": ...})
// of 150 to 250 ids under vocab 260, more than half of startTeacherd's
// token budget (one sample per forward pass: bit-exact answers, see
// newOnlineFixture), and returns the file.
func writePretokenized(t *testing.T, n int) string {
	t.Helper()
	recs := make([]map[string]any, n)
	for i := range recs {
		ids := make([]int, 150+(i*37)%101)
		for j := range ids {
			ids[j] = (i*31 + j*7 + j*j) % 260
		}
		recs[i] = map[string]any{"input_ids": ids}
	}
	file := filepath.Join(t.TempDir(), "ids.jsonl")
	writeJSONL(t, file, recs)
	return file
}

// TestOnlinePretokenizedNeedsNoTokenizer: online KD over pre-tokenized
// records (data.dataset.pretokenized) runs with no tokenizer on either
// side, the student's model.tokenizer and teacherd's --tokenizer both
// unset: the ids go to the teacher as they are, and only the
// vocabularies are compared. Its losses equal, step for step, those of
// the offline run from `cachectl fill --pretokenized`'s cache of the
// same teacher (same dataset fingerprint, same tokenizer fingerprint
// "pretokenized:vocab=260"). Without the flag the run names it; a
// student of another vocabulary is still refused.
func TestOnlinePretokenizedNeedsNoTokenizer(t *testing.T) {
	file := writePretokenized(t, 24)
	teacher := teacherModel(t, 32, 1)
	td := startTeacherd(t, teacher, "", filepath.Join(t.TempDir(), "cache"), filepath.Dir(file))

	on := onlineConfig(t, "", file, filepath.Join(t.TempDir(), "online"), "", []string{td.addr()}, "data.dataset.pretokenized=true")
	rn, log := run(t, on, Options{})
	if rn.Steps[0].KD == 0 || rn.Evals[0].KD == 0 {
		t.Fatalf("online run has no KD term: %+v %+v", rn.Steps[0], rn.Evals[0])
	}
	if !strings.Contains(log, "model.tokenizer_fingerprint: pretokenized:vocab=260") {
		t.Errorf("log lacks the student's tokenizer line:\n%s", log)
	}

	// The same teacher's cache of the same records, filled pre-tokenized.
	off := onlineConfig(t, "", file, filepath.Join(t.TempDir(), "offline"), fillCache(t, td, on), nil)
	ro, _ := run(t, off, Options{})
	sameLosses(t, "online pretokenized vs offline from a --pretokenized fill", rn, ro)

	// Without the flag, the error says what to set.
	plain := onlineConfig(t, "", file, filepath.Join(t.TempDir(), "plain"), "", []string{td.addr()})
	var buf bytes.Buffer
	if _, err := Run(plain, Options{Log: &buf}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "data.dataset.pretokenized: true") {
		t.Fatalf("no tokenizer, no pretokenized flag: got %v, want an ErrConfig naming data.dataset.pretokenized", err)
	}

	// The vocabularies are still checked against each other.
	wide := onlineConfig(t, "", file, filepath.Join(t.TempDir(), "wide"), "", []string{td.addr()}, "data.dataset.pretokenized=true", "model.random.vocab_size=300")
	buf.Reset()
	if _, err := Run(wide, Options{Log: &buf}); !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "vocab_size 260, but the student has 300") {
		t.Fatalf("student vocab 300 vs teacher 260: got %v, want the vocab mismatch", err)
	}
}

// TestPretokenizedSFTAndEvalNeedNoTokenizer: SFT over pre-tokenized
// records runs with no tokenizer, and EvaluateDataset (`student eval` on
// the config's data.dataset) reads them as the run did, also with none:
// its CE on the held-out samples is the run's final eval. A record with
// text instead of input_ids, or an id past the student's vocab_size, is a
// bad record naming the file and line, in training and in eval alike; with
// skip_bad both skip and count it.
func TestPretokenizedSFTAndEvalNeedNoTokenizer(t *testing.T) {
	dir := t.TempDir()
	recs := make([]map[string]any, 24)
	for i := range recs {
		ids := make([]int, 10+(i*7)%21)
		for j := range ids {
			ids[j] = (i*31 + j*7 + j*j) % 260
		}
		recs[i] = map[string]any{"input_ids": ids}
	}
	file := filepath.Join(dir, "ids.jsonl")
	writeJSONL(t, file, recs)
	over := []string{"model.tokenizer=", "data.dataset.pretokenized=true", "train.max_steps=4", "eval.every=0", "checkpoint.every=100"}
	cfg := sftConfig(t, "", file, filepath.Join(dir, "run"), over...)
	res, log := run(t, cfg, Options{})
	if !strings.Contains(log, "model.tokenizer_fingerprint: pretokenized:vocab=260") {
		t.Errorf("log lacks the student's tokenizer line:\n%s", log)
	}
	s, _, err := LoadStudent(res.Checkpoint)
	if err != nil {
		t.Fatal(err)
	}
	lo := cfg.LossOptions(cfg.Distill.Temperature)
	held := cache.Range{Start: 0, End: 12}
	es, _, err := EvaluateDataset(s, cfg.Data.Dataset, nil, cfg.Data.SeqLen, held, &lo)
	if err != nil {
		t.Fatalf("EvaluateDataset over pre-tokenized records with no tokenizer: %v", err)
	}
	if want := res.Evals[len(res.Evals)-1]; es.CE != want.CE || es.Tokens != want.Tokens || es.Samples != 12 {
		t.Fatalf("EvaluateDataset %+v, the run's final eval %+v", es, want)
	}

	// Record 3 (line 3) is text; record 21 (line 21) has an id past the
	// student's vocab. The first is held out (eval reads it), the second
	// a training step reads.
	bad := func(i int, rec map[string]any) string {
		rs := append([]map[string]any(nil), recs...)
		rs[i] = rec
		f := filepath.Join(t.TempDir(), "mixed.jsonl")
		writeJSONL(t, f, rs)
		return f
	}
	text := bad(2, map[string]any{"text": "hello"})
	dc := *cfg.Data.Dataset
	dc.Files = []string{text}
	if _, _, err := EvaluateDataset(s, &dc, nil, cfg.Data.SeqLen, held, &lo); err == nil ||
		!strings.Contains(err.Error(), "mixed.jsonl:3: no input_ids: a pre-tokenized dataset") || !strings.Contains(err.Error(), "pretokenized: false") {
		t.Errorf("eval over a text record: %v; want the file, the line, no input_ids and the fix", err)
	}
	dc.SkipBad = true
	if es, _, err := EvaluateDataset(s, &dc, nil, cfg.Data.SeqLen, held, &lo); err != nil || es.Samples != 11 {
		t.Errorf("eval with skip_bad over a text record: %+v %v; want 11 samples scored", es, err)
	}
	oov := bad(20, map[string]any{"input_ids": []int{1, 2, 260}})
	_, err = Run(sftConfig(t, "", oov, filepath.Join(t.TempDir(), "run"), over...), Options{Log: io.Discard})
	if err == nil || !strings.Contains(err.Error(), "mixed.jsonl:21: input_ids[2]: id out of vocab: token id 260 is outside [0, 260)") ||
		!strings.Contains(err.Error(), "data.dataset.skip_bad: true") {
		t.Fatalf("training over an id past the vocab: %v; want the file, the line, the id and skip_bad", err)
	}
	textTrain := bad(20, map[string]any{"messages": []map[string]string{{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}}})
	_, log = run(t, sftConfig(t, "", textTrain, filepath.Join(t.TempDir(), "run"), append(over, "data.dataset.skip_bad=true")...), Options{})
	// How often the read-ahead met the record depends on how far it read
	// (epochs, evals): only that it was skipped and counted is certain.
	if !regexp.MustCompile(`[1-9]\d* skipped \(no input_ids: [1-9]\d*\)`).MatchString(log) {
		t.Errorf("skip_bad over a chat record with no input_ids: want it skipped and counted:\n%s", log)
	}
}
