package runplot

import (
	"bytes"
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"gonum.org/v1/plot/plotutil"

	"distill/internal/testdirs"
)

// writeRun writes a metrics.jsonl into a new directory named name and
// returns the directory.
func writeRun(t *testing.T, name, content string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "metrics.jsonl"), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// metricsOf makes a run's metrics.jsonl as package trainer writes it:
// steps 1..n, an eval every 5 steps; kd is 0 when withKD is false (SFT).
func metricsOf(n int, withKD bool, offset float64) string {
	var b strings.Builder
	for s := 1; s <= n; s++ {
		ce := offset + 10*math.Exp(-float64(s)/8)
		kd := 0.0
		if withKD {
			kd = 8 * math.Exp(-float64(s)/6)
		}
		fmt.Fprintf(&b, `{"type":"train","step":%d,"loss":%g,"kd":%g,"ce":%g,"lr":%g,"grad_norm":%g,"tokens":1024,"loss_tokens":500,"rows":4,"tokens_per_s":1000,"data_s":0.001,"gflop_per_s":50,"peak_mem_bytes":1000,"epoch":0,"wall_time":1}`+"\n",
			s, kd+0.1*ce, kd, ce, 3e-3*float64(min(s, 5))/5, 1+1/float64(s))
		if s%5 == 0 {
			top1 := 0.0
			if withKD {
				top1 = 0.5 + float64(s)/100
			}
			fmt.Fprintf(&b, `{"type":"eval","step":%d,"loss":%g,"kd":%g,"ce":%g,"token_accuracy":%g,"top1_agreement":%g,"tokens":400,"samples":20}`+"\n",
				s, kd+0.1*ce+0.05, kd, ce+0.1, 0.4+float64(s)/100, top1)
		}
	}
	return b.String()
}

// TestLoad: train and eval lines are read in step order; null (a skipped
// step's NaN) is NaN; a step logged twice keeps its last line; a torn
// last line is ignored.
func TestLoad(t *testing.T) {
	dir := writeRun(t, "run-a", `{"type":"train","step":2,"loss":2,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}
{"type":"train","step":1,"loss":1,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}
{"type":"train","step":3,"loss":null,"kd":null,"ce":null,"lr":0.1,"grad_norm":null,"skipped":true}
{"type":"eval","step":3,"loss":5,"kd":1,"ce":2,"token_accuracy":0.5,"top1_agreement":0.25,"tokens":10,"samples":2}
{"type":"train","step":2,"loss":2.5,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}
{"type":"train","step":4,"loss":1`)
	r, err := Load(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	if r.Label != "run-a" {
		t.Errorf("label %q, want the directory's name run-a", r.Label)
	}
	var steps []int
	for _, s := range r.Train {
		steps = append(steps, s.Step)
	}
	if !reflect.DeepEqual(steps, []int{1, 2, 3}) {
		t.Fatalf("train steps %v, want [1 2 3] (the torn step 4 left out)", steps)
	}
	if r.Train[1].Loss != 2.5 {
		t.Errorf("step 2 loss %g, want the last line's 2.5", r.Train[1].Loss)
	}
	if s := r.Train[2]; !s.Skipped || !math.IsNaN(s.Loss) || !math.IsNaN(s.GradNorm) || s.LR != 0.1 {
		t.Errorf("skipped step 3: %+v, want NaN loss and grad norm, lr 0.1", s)
	}
	if len(r.Eval) != 1 || r.Eval[0].CE != 2 || r.Eval[0].TokenAccuracy != 0.5 || r.Eval[0].Top1Agreement != 0.25 {
		t.Errorf("eval %+v", r.Eval)
	}
	if r, err := Load(dir, "mine"); err != nil || r.Label != "mine" {
		t.Errorf("label: %v %v", r, err)
	}
}

// TestLoadTornMiddleLine: a run killed mid-write and resumed after the
// torn bytes has a line that is not JSON in the middle of its metrics; it
// is left out and listed (line 2), the lines after it are read, as a torn
// last line is ignored. It was an error, and the run could not be
// plotted at all.
func TestLoadTornMiddleLine(t *testing.T) {
	dir := writeRun(t, "run-a", `{"type":"train","step":1,"loss":1,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}
{"type":"train","step":2,"loss":{"type":"train","step":2,"loss":2,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}
{"type":"eval","step":2,"loss":5,"kd":1,"ce":2,"token_accuracy":0.5,"top1_agreement":0.25}
{"type":"train","step":3,"loss":3,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}
{"type":"train","step":4,"lo`)
	r, err := Load(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	var steps []int
	for _, s := range r.Train {
		steps = append(steps, s.Step)
	}
	if !reflect.DeepEqual(steps, []int{1, 3}) || len(r.Eval) != 1 {
		t.Errorf("train steps %v, %d evals; want [1 3] and 1 (the torn line 2 and the torn last line left out)", steps, len(r.Eval))
	}
	if !reflect.DeepEqual(r.Skipped, []int{2}) || r.Path != filepath.Join(dir, "metrics.jsonl") {
		t.Errorf("skipped %v in %s, want line 2 of %s (a torn last line is not listed)", r.Skipped, r.Path, filepath.Join(dir, "metrics.jsonl"))
	}
}

// TestLoadErrors: each bad run names what is wrong and where.
func TestLoadErrors(t *testing.T) {
	empty := t.TempDir()
	for _, c := range []struct {
		name, dir string
		want      []string
	}{
		{"missing dir", filepath.Join(empty, "nope"), []string{"run directory " + filepath.Join(empty, "nope") + " does not exist: give the run directory of a `student train` run"}},
		{"a file", writeRun(t, "r0", "{\"type\":\"train\",\"step\":1,\"loss\":1}\n") + "/metrics.jsonl", []string{"metrics.jsonl is a file, not a run directory: give the run directory"}},
		{"no metrics", empty, []string{"has no metrics.jsonl", "student train"}},
		// No line is JSON: not a metrics file (one bad line among good
		// ones is skipped: TestLoadTornMiddleLine).
		{"not json", writeRun(t, "r1", "hello\nworld\n{\"type\":\"train\",\"st"), []string{"metrics.jsonl line 1", "student train"}},
		{"no type", writeRun(t, "r2", "{\"step\":1,\"loss\":1}\n"), []string{"line 1", `"type" train or eval`}},
		{"no step", writeRun(t, "r3", "{\"type\":\"train\",\"loss\":1}\n"), []string{"line 1", `"step"`}},
		{"nothing yet", writeRun(t, "r4", ""), []string{"no train or eval lines yet"}},
	} {
		_, err := Load(c.dir, "")
		if err == nil || !errors.Is(err, ErrInput) {
			t.Errorf("%s: err %v, want ErrInput", c.name, err)
			continue
		}
		// The kind is for the code: its text ("runplot: bad input") led
		// every message the user read, and a Go call ("stat DIR: no
		// such file or directory") followed.
		if m := err.Error(); strings.Contains(m, "runplot") || strings.Contains(m, "stat ") || strings.Contains(m, "open ") {
			t.Errorf("%s: %q names the package or a system call", c.name, m)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v, want it to say %q", c.name, err, w)
			}
		}
	}
}

func TestParseHLine(t *testing.T) {
	for in, want := range map[string]HLine{
		"teacher CE=1.23":        {"ce", "teacher CE", 1.23},
		" loss : target = 0.5 ":  {"loss", "target", 0.5},
		"grad_norm:clip=1":       {"grad_norm", "clip", 1},
		"ratio a:b=2":            {"ce", "ratio a:b", 2},
		"speed:x=1":              {"ce", "speed:x", 1}, // no panel's name mistyped: a label
		"teacher (x=1) CE=-1e-3": {"ce", "teacher (x=1) CE", -1e-3},
	} {
		got, err := ParseHLine(in)
		if err != nil || got != want {
			t.Errorf("ParseHLine(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for in, why := range map[string]string{
		"teacher":   "no '='",
		"teacher=x": "not a finite number",
		"t=NaN":     "not a finite number",
		"t=Inf":     "not a finite number",
		"=1":        "empty label",
		"loss:=1":   "empty label",
		// A mistyped panel before the colon is not a label: it drew a
		// line labelled "kl:teacher" on the CE panel.
		"kl:teacher=0.3":   `unknown panel "kl" (did you mean kd? a label with a colon in it goes after a panel name: ce:kl:teacher)`,
		"CE:teacher=1":     `unknown panel "CE" (did you mean ce?`,
		"grad-norm:clip=1": `unknown panel "grad-norm" (did you mean grad_norm?`,
	} {
		_, err := ParseHLine(in)
		if err == nil || !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), why) || !strings.Contains(err.Error(), "[PANEL:]LABEL=VALUE") {
			t.Errorf("ParseHLine(%q): %v, want an ErrInput saying %q and the form", in, err, why)
		}
	}
}

// TestWritePNG draws a KD run and an SFT run with a reference line and
// checks what was drawn: the panels and their series, and in the PNG
// itself, that it decodes at the size asked for and that each panel's
// tile holds the colours of the runs drawn in it.
func TestWritePNG(t *testing.T) {
	kd, err := Load(writeRun(t, "kd", metricsOf(40, true, 0.5)), "KD + SFT")
	if err != nil {
		t.Fatal(err)
	}
	sft, err := Load(writeRun(t, "sft", metricsOf(40, false, 1)), "SFT only")
	if err != nil {
		t.Fatal(err)
	}
	h, err := ParseHLine("teacher CE=0.4")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "curves.png")
	ps, err := Write(out, []*Run{kd, sft}, []HLine{h}, Options{Width: 1200, Height: 700, Title: "test"})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	var names []string
	for _, p := range ps {
		got[p.Name] = p.Series
		names = append(names, p.Name)
	}
	if !reflect.DeepEqual(names, []string{"loss", "kd", "ce", "lr", "grad_norm", "accuracy"}) {
		t.Fatalf("panels %v", names)
	}
	want := map[string][]string{
		"loss": {"KD + SFT", "KD + SFT eval", "SFT only", "SFT only eval"},
		// The SFT run's KD is 0 throughout (no teacher): left out.
		"kd":        {"KD + SFT", "KD + SFT eval"},
		"ce":        {"KD + SFT", "KD + SFT eval", "SFT only", "SFT only eval", "teacher CE"},
		"lr":        {"KD + SFT", "SFT only"},
		"grad_norm": {"KD + SFT", "SFT only"},
		// A dataset eval has no teacher, so no top-1 agreement.
		"accuracy": {"KD + SFT token acc", "KD + SFT top-1 agr", "SFT only token acc"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("series\n got %v\nwant %v", got, want)
	}

	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("%s does not decode as PNG: %v", out, err)
	}
	if b := img.Bounds(); b.Dx() != 1200 || b.Dy() != 700 {
		t.Fatalf("PNG is %dx%d, want 1200x700", b.Dx(), b.Dy())
	}
	// Panels are laid out 3 per row: tile (i%3, i/3). Each must hold the
	// colour of every run drawn in it, and of no run left out of it.
	// The PNG is paletted: a run's colour is drawn as its nearest in the
	// palette.
	pal := img.ColorModel().(color.Palette)
	c0, c1 := pal.Convert(plotutil.Color(0)), pal.Convert(plotutil.Color(1))
	if c0 == c1 {
		t.Fatalf("the two runs' colours are one palette entry %v", c0)
	}
	for i, name := range names {
		b := img.Bounds()
		tw, th := b.Dx()/3, (b.Dy()-40)/2
		tile := image.Rect(i%3*tw, 40+i/3*th, (i%3+1)*tw, 40+(i/3+1)*th)
		has0, has1 := hasColor(img, tile, c0), hasColor(img, tile, c1)
		want1 := name != "kd"
		if !has0 || has1 != want1 {
			t.Errorf("panel %s (tile %v): run colours drawn %v %v, want true %v", name, tile, has0, has1, want1)
		}
	}
}

// hasColor reports whether at least 20 pixels of r in img are c.
func hasColor(img image.Image, r image.Rectangle, c color.Color) bool {
	cr, cg, cb, _ := c.RGBA()
	n := 0
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			pr, pg, pb, _ := img.At(x, y).RGBA()
			if pr>>8 == cr>>8 && pg>>8 == cg>>8 && pb>>8 == cb>>8 {
				n++
			}
		}
	}
	return n >= 20
}

// TestWriteFormats: .svg and .pdf are written too; other extensions are
// refused before anything is written, and an existing file is kept.
func TestWriteFormats(t *testing.T) {
	r, err := Load(writeRun(t, "run", metricsOf(10, true, 0)), "")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for ext, magic := range map[string]string{".svg": "<?xml", ".pdf": "%PDF"} {
		p := filepath.Join(dir, "c"+ext)
		if _, err := Write(p, []*Run{r}, nil, Options{}); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil || !bytes.HasPrefix(b, []byte(magic)) {
			t.Errorf("%s: %.20q %v, want it to start with %q", p, b, err, magic)
		}
	}
	keep := filepath.Join(dir, "c.jpg")
	if err := os.WriteFile(keep, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Write(keep, []*Run{r}, nil, Options{}); err == nil || !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), ".png, .svg or .pdf") {
		t.Errorf("c.jpg: %v", err)
	}
	if b, _ := os.ReadFile(keep); string(b) != "old" {
		t.Errorf("c.jpg was changed to %q", b)
	}
}

// TestWriteErrors: bad runs, lines, sizes and destinations are refused
// with errors that say what to do, and nothing is left behind.
func TestWriteErrors(t *testing.T) {
	r, err := Load(writeRun(t, "run", metricsOf(10, true, 0)), "")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "c.png")
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	ro := testdirs.Unwritable(t)
	for _, c := range []struct {
		name   string
		runs   []*Run
		hlines []HLine
		o      Options
		path   string
		want   string
	}{
		{"no runs", nil, nil, Options{}, out, "give --run DIR"},
		{"unknown panel", []*Run{r}, []HLine{{Panel: "speed", Label: "x", Value: 1}}, Options{}, out, `unknown panel "speed"`},
		{"tiny", []*Run{r}, nil, Options{Width: 10, Height: 10}, out, "size 10x10"},
		{"unknown chosen panel", []*Run{r}, nil, Options{Select: Select{Panels: []string{"ce", "speed"}}}, out, `unknown panel "speed"`},
		{"no chosen panel", []*Run{r}, nil, Options{Select: Select{Panels: []string{}}}, out, "no panels chosen"},
		{"from past the end", []*Run{r}, nil, Options{Select: Select{From: 11}}, out, "nothing to draw"},
		{"no dir", []*Run{r}, nil, Options{}, filepath.Join(dir, "missing", "c.png"), "--out " + filepath.Join(dir, "missing", "c.png") + ": its directory " + filepath.Join(dir, "missing") + " does not exist: create it (mkdir -p"},
		{"dir a file", []*Run{r}, nil, Options{}, filepath.Join(file, "c.png"), "its directory " + file + " is a file, not a directory: choose another --out"},
		{"unwritable dir", []*Run{r}, nil, Options{}, filepath.Join(ro, "c.png"), "--out: writing " + filepath.Join(ro, "c.png") + ": cannot create a file in " + ro + ": "},
		{"panel twice", []*Run{r}, nil, Options{Select: Select{Panels: []string{"ce", "kd", "ce"}}}, out, "panel ce named twice in --panels"},
		{"line on a panel not drawn", []*Run{r}, []HLine{{Panel: "kd", Label: "x", Value: 1}}, Options{Select: Select{Panels: []string{"ce"}}}, out, `reference line "x" is on panel kd, which --panels ce leaves out`},
	} {
		_, err := Write(c.path, c.runs, c.hlines, c.o)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), ".tmp") || strings.HasPrefix(err.Error(), "runplot") {
			t.Errorf("%s: %v, want it to say %q", c.name, err, c.want)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("left behind: %v", ents)
	}
}

// TestSelect: chosen panels come in the order asked for; From leaves out
// the points of earlier steps, train and eval alike, and a run left
// with none in a panel is not in its legend.
func TestSelect(t *testing.T) {
	long, err := Load(writeRun(t, "long", metricsOf(40, true, 0)), "")
	if err != nil {
		t.Fatal(err)
	}
	short, err := Load(writeRun(t, "short", metricsOf(12, false, 0)), "")
	if err != nil {
		t.Fatal(err)
	}
	ps, err := Panels([]*Run{long, short}, nil, Select{Panels: []string{"ce", "lr"}, From: 15})
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 2 || ps[0].Name != "ce" || ps[1].Name != "lr" {
		t.Fatalf("panels %+v", ps)
	}
	if !reflect.DeepEqual(ps[0].Series, []string{"long", "long eval"}) {
		t.Errorf("ce series %v: the short run ends at step 12", ps[0].Series)
	}
	// The plotted data: the first x of every line is >= 15.
	for _, p := range ps {
		if p.Plot.X.Min < 15 {
			t.Errorf("panel %s starts at step %g", p.Name, p.Plot.X.Min)
		}
	}
}

// TestLogTicks: a loss falling from 12 to 0.3 gets labelled ticks at
// 1, 2 and 5 times each power of ten inside the range.
func TestLogTicks(t *testing.T) {
	var labels []string
	for _, tk := range (logTicks{}).Ticks(0.3, 12) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	if !reflect.DeepEqual(labels, []string{"0.5", "1", "2", "5", "10"}) {
		t.Errorf("labels %v", labels)
	}
}

// TestPanelAxes: every panel labels its axes with the quantity and, for
// the losses, the unit; the loss panel says that it is each run's own
// objective.
func TestPanelAxes(t *testing.T) {
	r, err := Load(writeRun(t, "a", metricsOf(20, true, 0)), "")
	if err != nil {
		t.Fatal(err)
	}
	ps, err := Panels([]*Run{r}, nil, Select{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		if p.Plot.X.Label.Text != "optimizer step" || p.Plot.Y.Label.Text == "" {
			t.Errorf("panel %s: axes %q, %q", p.Name, p.Plot.X.Label.Text, p.Plot.Y.Label.Text)
		}
		if (p.Name == "ce" || p.Name == "kd" || p.Name == "loss") && !strings.Contains(p.Plot.Y.Label.Text, "(nats/token)") {
			t.Errorf("panel %s: y axis %q has no unit", p.Name, p.Plot.Y.Label.Text)
		}
		if p.Name == "loss" && !strings.Contains(p.Plot.Title.Text, "own objective") {
			t.Errorf("loss panel title %q", p.Plot.Title.Text)
		}
	}
}
