package trainer

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"
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
