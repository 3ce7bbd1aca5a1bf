package main

import (
	"bytes"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const header = "seed\tstudent\tcache\tbytes_per_token\tce\tece\ttop1_agreement\tkd\ttoken_accuracy\teval_tokens\n"

// TestAggregate checks the mean and the sample standard deviation over
// the seeds against values worked by hand, and the rows' order (by bytes).
func TestAggregate(t *testing.T) {
	in := header +
		"1\tsampled16\tsampled16\t12\t1.0\t0.10\t0.8\t0.3\t0.5\t1727\n" +
		"2\tsampled16\tsampled16\t12\t2.0\t0.20\t0.8\t0.3\t0.5\t1700\n" +
		"3\tsampled16\tsampled16\t12\t4.0\t0.30\t0.8\t0.3\t0.5\t1690\n" +
		"1\ttopk8-bucket\ttopk8\t6\t1.5\t0.12\t0.9\t0.2\t0.5\t1727\n" +
		"3\ttopk8-bucket\ttopk8\t6\t3.0\t0.12\t0.9\t0.2\t0.5\t1727\n" +
		"2\tsampled50\tsampled50\t20\t1.7\t0.09\t0.8\t0.3\t0.5\t1727\n"
	rows, err := parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := aggregate(rows, "topk16-bucket"); err == nil || !strings.Contains(err.Error(), "--ref topk16-bucket: no row of that student (have sampled16, sampled50, topk8-bucket)") {
		t.Errorf("a --ref no row names: error %v", err)
	}
	ks, err := aggregate(rows, "topk8-bucket")
	if err != nil {
		t.Fatal(err)
	}
	if len(ks) != 3 || ks[0].student != "topk8-bucket" || ks[1].student != "sampled16" {
		t.Fatalf("kinds %+v: want topk8-bucket (6 bytes), sampled16 (12), sampled50 (20)", ks)
	}
	s := ks[1]
	// CE 1, 2, 4: mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9,
	// over n - 1 = 2: 7/3. ECE 0.1, 0.2, 0.3: mean 0.2, std 0.1.
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"ce mean", s.ce.mean, 7.0 / 3}, {"ce std", s.ce.std, math.Sqrt(7.0 / 3)},
		{"ece mean", s.ece.mean, 0.2}, {"ece std", s.ece.std, 0.1},
		{"bytes std", s.bytes.std, 0},
		// Against topk8-bucket on seeds 1 and 3 only: CE 1 - 1.5 and
		// 4 - 3, mean 0.25, std |(-0.5) - 1| / sqrt(2); ECE 0.1 - 0.12
		// and 0.3 - 0.12: mean 0.08, std 0.2 / sqrt(2).
		{"dce mean", s.dCE.mean, 0.25}, {"dce std", s.dCE.std, 1.5 / math.Sqrt2},
		{"dece mean", s.dECE.mean, 0.08}, {"dece std", s.dECE.std, 0.2 / math.Sqrt2},
	} {
		if math.Abs(c.got-c.want) > 1e-12 {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	if len(s.seeds) != 3 || s.seeds[0] != 1 || s.seeds[2] != 3 {
		t.Errorf("seeds %v, want [1 2 3]", s.seeds)
	}
	if one := ks[2]; one.student != "sampled50" || !math.IsNaN(one.ce.std) || !math.IsNaN(one.dCE.mean) {
		t.Errorf("one seed, without the reference's: %+v, want no std and no difference (NaN)", one)
	}
	if len(s.dSeeds) != 2 || s.dSeeds[0] != 1 || s.dSeeds[1] != 3 {
		t.Errorf("differences over seeds %v, want [1 3]", s.dSeeds)
	}
	if ks[0].dCE.mean != 0 || ks[0].dCE.std != 0 {
		t.Errorf("the reference against itself: %+v, want 0 ± 0", ks[0].dCE)
	}
	var b bytes.Buffer
	if err := table(&b, ks, "topk8-bucket"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"CE - top-8, tail bucket's, same seed |",
		"| top-8, tail bucket | 1, 3 | 6.0 ± 0.0 | 2.2500 ± 1.0607 | 0.1200 ± 0.0000 | 0.9000 ± 0.0000 | 0.2000 ± 0.0000 |  |  |",
		"| sampled, N 50 | 2 | 20.0 | 1.7000 | 0.0900 | 0.8000 | 0.3000 |  |  |",
		"| sampled, N 16 | 1, 2, 3 | 12.0 ± 0.0 | 2.3333 ± 1.5275 | 0.2000 ± 0.1000 | 0.8000 ± 0.0000 | 0.3000 ± 0.0000 | +0.2500 ± 1.0607 (seeds 1, 3) | +0.0800 ± 0.1414 |",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table\n%s\nlacks %q", b.String(), want)
		}
	}
}

func TestDescribe(t *testing.T) {
	for _, c := range []struct{ in, label, family, tag string }{
		{"topk64-renormalize", "top-64, renormalize", "top-k, renormalize", "k64"},
		{"topk16-bucket", "top-16, tail bucket", "top-k, tail bucket", "k16"},
		{"sampled50", "sampled, N 50", "sampled", "N50"},
		{"head8+sampled50", "head 8 + sampled 50", "head + sampled", "8+50"},
		{"other", "other", "other", "other"},
	} {
		l, f, g := describe(c.in)
		if l != c.label || f != c.family || g != c.tag {
			t.Errorf("describe(%q) = %q, %q, %q; want %q, %q, %q", c.in, l, f, g, c.label, c.family, c.tag)
		}
	}
}

func TestParseErrors(t *testing.T) {
	row := "1\tsampled16\tsampled16\t12\t1.0\t0.10\t0.8\t0.3\t0.5\t1727\n"
	for _, c := range []struct{ name, in, want string }{
		{"header", "seed\tstudent\n" + row, "line 1: header"},
		{"short row", header + "1\tsampled16\tsampled16\t12\t1.0\n", "line 2: 5 fields, want 10"},
		{"empty number", header + "1\tsampled16\tsampled16\t12\t\t0.10\t0.8\t0.3\t0.5\t1727\n", `line 2: ce "" is not a finite number`},
		{"NaN", header + "1\tsampled16\tsampled16\t12\tNaN\t0.10\t0.8\t0.3\t0.5\t1727\n", `line 2: ce "NaN" is not a finite number`},
		{"seed", header + "x" + row[1:], `line 2: seed "x"`},
		{"twice", header + row + row, "line 3: seed 1, student sampled16 again (first on line 2)"},
		{"none", header, "no rows"},
	} {
		_, err := parse(strings.NewReader(c.in))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
}

// TestRunWritesPlot runs the command's path end to end: the table on
// stdout and a PNG of the stated size; a name not ending in .png is
// refused and writes nothing.
func TestRunWritesPlot(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "results.tsv")
	rows := header
	for _, s := range []string{"1", "2"} {
		rows += s + "\ttopk8-bucket\ttopk8\t6.2\t1.64\t0.11\t0.90\t0.26\t0.55\t1727\n" +
			s + "\ttopk8-renormalize\ttopk8\t6.2\t1.70\t0.13\t0.91\t0.28\t0.55\t1727\n" +
			s + "\tsampled16\tsampled16\t11.9\t1.6" + s + "\t0.10\t0.83\t0.33\t0.55\t1727\n" +
			s + "\thead4+sampled16\thead4+sampled16\t24.6\t1.67\t0.10\t0.84\t0.32\t0.55\t1727\n"
	}
	if err := os.WriteFile(in, []byte(rows), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "plot.png")
	var b bytes.Buffer
	if err := run(in, out, "", "sampled16", &b); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(b.String(), "\n"); n != 2+4 {
		t.Errorf("table has %d lines, want 6:\n%s", n, b.String())
	}
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("the plot is not a PNG: %v", err)
	}
	if r := img.Bounds(); r.Dx() != 1500 || r.Dy() != 1100 {
		t.Errorf("plot %v, want 1500x1100", r)
	}
	bad := filepath.Join(dir, "plot.svg")
	if err := run(in, bad, "", "sampled16", &b); err == nil || !strings.Contains(err.Error(), "must end in .png") {
		t.Errorf("--out plot.svg: error %v, want the .png one", err)
	}
	if _, err := os.Stat(bad); err == nil {
		t.Errorf("%s written after the error", bad)
	}
}
