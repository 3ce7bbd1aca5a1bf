package examples

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestQuickstart runs the README's first command, scripts/quickstart.sh,
// as printed but on tiny data for a few steps (QS_TINY=1; the tokenizer
// from the test data instead of npm): every stage runs (data, teacher,
// fill, verify, both students, export, eval, plot) and writes the table,
// the margin line and the plot; the SFT-only student's evals are scored
// against the cache (eval.cache: their KD is not 0). Its numbers mean
// nothing at this size.
// Then scripts/measure-targets.sh on its outputs: a row of figures for
// every cache kind and tail mode, for both students; and
// scripts/measure-students.sh on them as teacher seed 1's quick start: a
// row of results for each of three kinds of student, for 2 steps each.
func TestQuickstart(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the quick start builds the binaries and trains three models")
	}
	if _, err := os.Stat(filepath.Join(qwen3Dir, "tokenizer.json")); err != nil {
		t.Fatalf("no Qwen3 tokenizer in the test data (scripts/setup-test.sh fetches it): %v", err)
	}
	tok, err := filepath.Abs(qwen3Dir)
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	log, err := repoScript([]string{"QS_TINY=1", "QS_OUT=" + out, "QS_TOKENIZER=" + tok}, "scripts/quickstart.sh")
	if err != nil {
		t.Fatalf("scripts/quickstart.sh: %v\n%s", err, log)
	}
	table, err := os.ReadFile(filepath.Join(out, "table.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range []string{`\| teacher \(20.4M\) \| [0-9.]+ \| [0-9.]+ \| 1.0000 \|`, `\| student, KD \+ SFT \(10.0M\) \| [0-9.]+ \|`,
		`\| student, SFT only \(10.0M\) \| [0-9.]+ \|`, `\| the language itself .* \| [0-9.]+ \|`, `KD margin on held-out CE \(SFT only - KD \+ SFT\): [-+][0-9.]+`} {
		if !regexp.MustCompile(row).Match(table) {
			t.Errorf("table.md lacks a line matching %s:\n%s", row, table)
		}
	}
	if st, err := os.Stat(filepath.Join(out, "quickstart.png")); err != nil || st.Size() == 0 {
		t.Errorf("no plot: %v", err)
	}
	m, err := os.ReadFile(filepath.Join(out, "student-sft", "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var evals int
	for _, l := range strings.Split(string(m), "\n") {
		if strings.Contains(l, `"type":"eval"`) {
			evals++
			// Without a teacher an eval's KD is exactly 0 (top-1 agreement
			// may be 0 on these tiny models either way).
			if !strings.Contains(l, `"top1_agreement":`) || regexp.MustCompile(`"kd":0[,}]`).MatchString(l) {
				t.Errorf("an SFT-only eval not scored against the teacher (eval.cache): %s", l)
			}
		}
	}
	if evals == 0 {
		t.Errorf("the SFT-only run wrote no eval line:\n%s", m)
	}
	// The measurement of the targets' bias (docs/sampled-targets.md) runs
	// on its outputs.
	log, err = repoScript([]string{"QS_OUT=" + out, "TB_RANGE=0:3"}, "scripts/measure-targets.sh")
	if err != nil {
		t.Fatalf("scripts/measure-targets.sh: %v\n%s", err, log)
	}
	for _, s := range []string{"kd", "sft"} {
		b, err := os.ReadFile(filepath.Join(out, "targets", "bias-"+s+".md"))
		if err != nil {
			t.Fatal(err)
		}
		rows := regexp.MustCompile(`(?m)^\| [a-z0-9+]+(, tail [a-z]+)? \| [0-9.]+ \| [0-9.]+° \| [-0-9.]+ \| [0-9.]+° \|$`).FindAll(b, -1)
		if len(rows) != 13 { // 3 top-k caches x 3 tail modes, 4 sampled caches
			t.Errorf("bias-%s.md: %d rows of figures, want 13:\n%s", s, len(rows), b)
		}
	}

	// The table of students trained on each kind (docs/sampled-targets.md):
	// the script finds seed s's quick start at MS_QS + s.
	tmp := t.TempDir()
	if err := os.Symlink(out, filepath.Join(tmp, "qs-1")); err != nil {
		t.Fatal(err)
	}
	sout := filepath.Join(tmp, "students")
	kinds := []string{"topk8-renormalize", "sampled16", "head4+sampled16"}
	log, err = repoScript([]string{"MS_QS=" + filepath.Join(tmp, "qs-"), "MS_OUT=" + sout, "MS_SEEDS=1", "MS_KINDS=" + strings.Join(kinds, " "),
		"MS_STEPS=2", "MS_HELD=0:40"}, "scripts/measure-students.sh")
	if err != nil {
		t.Fatalf("scripts/measure-students.sh: %v\n%s", err, log)
	}
	res, err := os.ReadFile(filepath.Join(sout, "results.tsv"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(res)), "\n")
	if len(lines) != 1+len(kinds) {
		t.Fatalf("results.tsv: %d lines, want a header and %d rows:\n%s", len(lines), len(kinds), res)
	}
	num := `[0-9.]+(e-?[0-9]+)?`
	for i, k := range kinds {
		row := regexp.MustCompile(`^1\t` + regexp.QuoteMeta(k) + `\t[a-z0-9+]+(\t` + num + `){6}\t[1-9][0-9]*$`)
		if !row.MatchString(lines[1+i]) {
			t.Errorf("results.tsv row %d: %q, want seed 1, %s, its cache, 6 figures and the eval tokens", i+1, lines[1+i], k)
		}
	}
	tch, err := os.ReadFile(filepath.Join(sout, "teachers.tsv"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^1(\t` + num + `){3}$`).Match(tch) {
		t.Errorf("teachers.tsv lacks seed 1's teacher CE, ECE and the held-out entropy:\n%s", tch)
	}
}
