// Command studentsplot turns the rows scripts/measure-students.sh writes
// (results.tsv: one quick-start student per teacher seed and kind of
// sparse teacher target) into issue 27's table and plot: per kind, the
// mean ± standard deviation over the teacher seeds of the cache's bytes a
// token, the student's held-out CE, expected calibration error, top-1
// agreement with the teacher and KD to it.
//
//	studentsplot --in out/students/results.tsv --out docs/sampled-students.png
//
// It prints the table (markdown) on stdout and draws four panels (held-out
// CE, ECE, top-1 agreement and CE minus the reference's on the same seed,
// against bytes a token), one colour per family
// of kinds (top-k with tail bucket, top-k renormalized, sampled, head +
// sampled), the points of a family joined in order of bytes, with error bars
// of one standard deviation over the seeds on both axes. The standard
// deviation is the sample one (n - 1); a kind with one seed has none, and
// the table says which seeds each row covers.
//
// The seeds differ in their data and teacher as well as in the student's
// initialization, so the spread of a kind's CE over the seeds is mostly
// theirs; the table's last two columns take it out: each kind's CE and
// ECE minus the reference kind's (--ref, default top-16 with tail bucket,
// the quick start's) on the same teacher seed, mean ± std over the seeds
// both have.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"image"
	"image/color"
	"image/color/palette"
	xdraw "image/draw"
	"image/png"
	"io"
	"math"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"distill/internal/atomicfile"
)

func main() {
	in := flag.String("in", "out/students/results.tsv", "scripts/measure-students.sh's results")
	out := flag.String("out", "", "the plot to write (.png; none if empty)")
	title := flag.String("title", "", "the plot's title (default: one naming the seeds)")
	ref := flag.String("ref", "topk16-bucket", "the student the last columns are differences from, seed by seed")
	flag.Parse()
	if err := run(*in, *out, *title, *ref, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "studentsplot:", err)
		os.Exit(1)
	}
}

func run(in, out, title, ref string, w io.Writer) error {
	f, err := os.Open(in)
	if err != nil {
		return fmt.Errorf("%v: run scripts/measure-students.sh first (it writes results.tsv)", err)
	}
	defer f.Close()
	rows, err := parse(f)
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	kinds, err := aggregate(rows, ref)
	if err != nil {
		return fmt.Errorf("%s: %w", in, err)
	}
	if err := table(w, kinds, ref); err != nil {
		return err
	}
	if out == "" {
		return nil
	}
	if title == "" {
		title = "Quick-start students (10M, 200 steps) trained on each kind of teacher target: mean ± std over teacher seeds " + seedList(kinds)
	}
	return draw2(out, title, ref, kinds)
}

// row is one line of results.tsv.
type row struct {
	seed                      int
	student, cache            string
	bytes, ce, ece, top1, kd  float64
	tokenAccuracy, evalTokens float64
}

// columns are results.tsv's, in order (its header line names them).
var columns = []string{"seed", "student", "cache", "bytes_per_token", "ce", "ece", "top1_agreement", "kd", "token_accuracy", "eval_tokens"}

// parse reads results.tsv: the header, then one row per (seed, student).
// A row with a missing or unparsable field, or a (seed, student) given
// twice, is an error naming its line.
func parse(r io.Reader) ([]row, error) {
	sc := bufio.NewScanner(r)
	line := 0
	var rows []row
	seen := map[string]int{}
	for sc.Scan() {
		line++
		t := strings.TrimRight(sc.Text(), "\r")
		if line == 1 {
			if t != strings.Join(columns, "\t") {
				return nil, fmt.Errorf("line 1: header %q: want the columns %s, tab-separated (scripts/measure-students.sh's)", t, strings.Join(columns, ", "))
			}
			continue
		}
		if t == "" {
			continue
		}
		fs := strings.Split(t, "\t")
		if len(fs) != len(columns) {
			return nil, fmt.Errorf("line %d: %d fields, want %d (%s): a row of an eval that did not finish? rerun scripts/measure-students.sh", line, len(fs), len(columns), strings.Join(columns, ", "))
		}
		var x row
		seed, err := strconv.Atoi(fs[0])
		if err != nil {
			return nil, fmt.Errorf("line %d: seed %q: %v", line, fs[0], err)
		}
		x.seed, x.student, x.cache = seed, fs[1], fs[2]
		for i, p := range []*float64{&x.bytes, &x.ce, &x.ece, &x.top1, &x.kd, &x.tokenAccuracy, &x.evalTokens} {
			v, err := strconv.ParseFloat(fs[3+i], 64)
			if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
				return nil, fmt.Errorf("line %d: %s %q is not a finite number: a row of an eval that did not finish? rerun scripts/measure-students.sh", line, columns[3+i], fs[3+i])
			}
			*p = v
		}
		key := fs[0] + "\t" + fs[1]
		if l, ok := seen[key]; ok {
			return nil, fmt.Errorf("line %d: seed %d, student %s again (first on line %d)", line, seed, x.student, l)
		}
		seen[key] = line
		rows = append(rows, x)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, errors.New("no rows: no student has finished yet")
	}
	return rows, nil
}

// stat is a mean and a sample standard deviation (NaN with one value).
type stat struct{ mean, std float64 }

func meanStd(v []float64) stat {
	var s float64
	for _, x := range v {
		s += x
	}
	m := s / float64(len(v))
	if len(v) < 2 {
		return stat{m, math.NaN()}
	}
	var ss float64
	for _, x := range v {
		ss += (x - m) * (x - m)
	}
	return stat{m, math.Sqrt(ss / float64(len(v)-1))}
}

// kind is one student configuration over the seeds.
type kind struct {
	student                  string
	seeds                    []int
	bytes, ce, ece, top1, kd stat
	// dCE and dECE are CE and ECE minus the reference student's on the
	// same seed, over the seeds both have (dSeeds).
	dCE, dECE stat
	dSeeds    []int
}

// aggregate groups the rows by student, in order of mean bytes a token
// (then name), with each student's differences from ref's, seed by seed.
// A ref no row names is an error.
func aggregate(rows []row, ref string) ([]kind, error) {
	by := map[string][]row{}
	refOf := map[int]row{}
	for _, r := range rows {
		by[r.student] = append(by[r.student], r)
		if r.student == ref {
			refOf[r.seed] = r
		}
	}
	if len(refOf) == 0 {
		names := make([]string, 0, len(by))
		for n := range by {
			names = append(names, n)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("--ref %s: no row of that student (have %s)", ref, strings.Join(names, ", "))
	}
	var ks []kind
	for name, rs := range by {
		sort.Slice(rs, func(i, j int) bool { return rs[i].seed < rs[j].seed })
		k := kind{student: name}
		col := func(f func(row) float64) stat {
			v := make([]float64, len(rs))
			for i, r := range rs {
				v[i] = f(r)
			}
			return meanStd(v)
		}
		for _, r := range rs {
			k.seeds = append(k.seeds, r.seed)
		}
		k.bytes = col(func(r row) float64 { return r.bytes })
		k.ce = col(func(r row) float64 { return r.ce })
		k.ece = col(func(r row) float64 { return r.ece })
		k.top1 = col(func(r row) float64 { return r.top1 })
		k.kd = col(func(r row) float64 { return r.kd })
		var dce, dece []float64
		for _, r := range rs {
			if b, ok := refOf[r.seed]; ok {
				dce, dece = append(dce, r.ce-b.ce), append(dece, r.ece-b.ece)
				k.dSeeds = append(k.dSeeds, r.seed)
			}
		}
		if len(dce) > 0 {
			k.dCE, k.dECE = meanStd(dce), meanStd(dece)
		} else {
			k.dCE, k.dECE = stat{math.NaN(), math.NaN()}, stat{math.NaN(), math.NaN()}
		}
		ks = append(ks, k)
	}
	sort.Slice(ks, func(i, j int) bool {
		if ks[i].bytes.mean != ks[j].bytes.mean {
			return ks[i].bytes.mean < ks[j].bytes.mean
		}
		return ks[i].student < ks[j].student
	})
	return ks, nil
}

var (
	reTopK    = regexp.MustCompile(`^topk(\d+)-(bucket|renormalize|zero)$`)
	reSampled = regexp.MustCompile(`^sampled(\d+)$`)
	reHead    = regexp.MustCompile(`^head(\d+)\+sampled(\d+)$`)
)

// refLabel is the reference student's short name in the plot.
func refLabel(ref string) string {
	l, _, _ := describe(ref)
	return strings.ReplaceAll(l, "tail ", "")
}

// describe names a student of scripts/measure-students.sh for the table
// (label), its family (one colour and line in the plot) and a short tag for
// its point.
func describe(student string) (label, family, tag string) {
	if m := reTopK.FindStringSubmatch(student); m != nil {
		if m[2] == "bucket" {
			return "top-" + m[1] + ", tail bucket", "top-k, tail bucket", "k" + m[1]
		}
		return "top-" + m[1] + ", " + m[2], "top-k, " + m[2], "k" + m[1]
	}
	if m := reSampled.FindStringSubmatch(student); m != nil {
		return "sampled, N " + m[1], "sampled", "N" + m[1]
	}
	if m := reHead.FindStringSubmatch(student); m != nil {
		return "head " + m[1] + " + sampled " + m[2], "head + sampled", m[1] + "+" + m[2]
	}
	return student, student, student
}

func pm(s stat, prec int) string {
	if math.IsNaN(s.mean) {
		return ""
	}
	if math.IsNaN(s.std) {
		return strconv.FormatFloat(s.mean, 'f', prec, 64)
	}
	return strconv.FormatFloat(s.mean, 'f', prec, 64) + " ± " + strconv.FormatFloat(s.std, 'f', prec, 64)
}

func ints(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ", ")
}

// seedList names the seeds any kind covers ("1, 2, 3").
func seedList(ks []kind) string {
	set := map[int]bool{}
	for _, k := range ks {
		for _, s := range k.seeds {
			set[s] = true
		}
	}
	var v []int
	for s := range set {
		v = append(v, s)
	}
	sort.Ints(v)
	return ints(v)
}

func table(w io.Writer, ks []kind, ref string) error {
	bw := bufio.NewWriter(w)
	rl, _, _ := describe(ref)
	fmt.Fprintf(bw, "| target | teacher seeds | bytes a token | held-out CE | expected calibration error | top-1 agreement | KD to the teacher (top-16, bucket) | CE - %s's, same seed | ECE - %s's, same seed |\n", rl, rl)
	fmt.Fprintln(bw, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, k := range ks {
		label, _, _ := describe(k.student)
		dce, dece := signed(k.dCE, 4), signed(k.dECE, 4)
		if len(k.dSeeds) != len(k.seeds) && len(k.dSeeds) > 0 {
			dce += " (seeds " + ints(k.dSeeds) + ")"
		}
		if k.student == ref {
			dce, dece = "", ""
		}
		fmt.Fprintf(bw, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", label, ints(k.seeds), pm(k.bytes, 1), pm(k.ce, 4), pm(k.ece, 4), pm(k.top1, 4), pm(k.kd, 4), dce, dece)
	}
	return bw.Flush()
}

// signed is pm with the mean's sign always written.
func signed(s stat, prec int) string {
	t := pm(s, prec)
	if t != "" && s.mean >= 0 {
		t = "+" + t
	}
	return t
}

// points is one family's kinds as an XY series with error bars and tags.
type points struct {
	plotter.XYs
	plotter.XErrors
	plotter.YErrors
	tags []string
}

func (p points) Label(i int) string { return p.tags[i] }

func errOf(s stat) plotter.Errors {
	e := s.std
	if math.IsNaN(e) {
		e = 0
	}
	return plotter.Errors{{Low: e, High: e}}
}

// familyColors fixes each family's colour, so that the plots of two runs
// of the script read alike.
var familyColors = map[string]color.RGBA{
	"top-k, tail bucket": {R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	"top-k, renormalize": {R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	"sampled":            {R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	"head + sampled":     {R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
}

// panelOf draws one metric against bytes a token.
func panelOf(name string, ks []kind, metric func(kind) stat) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = name
	p.X.Label.Text = "cache bytes a token"
	p.Y.Label.Text = name
	p.Add(plotter.NewGrid())
	fams := map[string]*points{}
	var order []string
	for _, k := range ks { // ks is in order of bytes
		_, fam, tag := describe(k.student)
		if math.IsNaN(metric(k).mean) {
			continue
		}
		f := fams[fam]
		if f == nil {
			f = &points{}
			fams[fam] = f
			order = append(order, fam)
		}
		m := metric(k)
		if math.IsNaN(m.mean) {
			continue // no difference: no seed of the reference's
		}
		f.XYs = append(f.XYs, plotter.XY{X: k.bytes.mean, Y: m.mean})
		f.XErrors = append(f.XErrors, errOf(k.bytes)...)
		f.YErrors = append(f.YErrors, errOf(m)...)
		f.tags = append(f.tags, tag)
	}
	other := []color.RGBA{{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}, {R: 0x8c, G: 0x56, B: 0x4b, A: 0xff}, {R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}}
	for i, fam := range order {
		f := fams[fam]
		c, ok := familyColors[fam]
		if !ok {
			c = other[i%len(other)]
		}
		ln, err := plotter.NewLine(f.XYs)
		if err != nil {
			return nil, err
		}
		ln.Color, ln.Width = c, vg.Points(1.5)
		sc, err := plotter.NewScatter(f.XYs)
		if err != nil {
			return nil, err
		}
		sc.GlyphStyle = draw.GlyphStyle{Color: c, Radius: vg.Points(3.5), Shape: draw.CircleGlyph{}}
		ye, err := plotter.NewYErrorBars(f)
		if err != nil {
			return nil, err
		}
		ye.Color = c
		xe, err := plotter.NewXErrorBars(f)
		if err != nil {
			return nil, err
		}
		xe.Color = c
		lb, err := plotter.NewLabels(f)
		if err != nil {
			return nil, err
		}
		for j := range lb.TextStyle {
			lb.TextStyle[j].Color = c
			lb.TextStyle[j].Font.Size = vg.Points(9)
		}
		lb.Offset = vg.Point{X: vg.Points(5), Y: vg.Points(3)}
		p.Add(ln, ye, xe, sc, lb)
		p.Legend.Add(fam, ln, sc)
	}
	p.Legend.Top = true
	// Room for the legend above the points, and for the tags right of
	// the last ones.
	p.Y.Max += 0.45 * (p.Y.Max - p.Y.Min)
	p.X.Min, p.X.Max = 0, 1.1*p.X.Max
	p.Y.Tick.Marker = fixedTicks{}
	return p, nil
}

// fixedTicks are gonum's default ticks labelled with as many decimals as
// their spacing needs (the default's %g labels ticks 0.02 apart near 1.7
// all "1.7").
type fixedTicks struct{}

func (fixedTicks) Ticks(min, max float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(min, max)
	var labelled []float64
	for _, t := range ts {
		if t.Label != "" {
			labelled = append(labelled, t.Value)
		}
	}
	if len(labelled) < 2 {
		return ts
	}
	d := labelled[1] - labelled[0]
	prec := 0
	if d > 0 && d < 1 {
		prec = int(math.Ceil(-math.Log10(d) - 1e-9))
	}
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'f', prec, 64)
		}
	}
	return ts
}

// draw2 writes the three panels side by side into path (.png).
func draw2(path, title, ref string, ks []kind) error {
	if !strings.HasSuffix(strings.ToLower(path), ".png") {
		return fmt.Errorf("--out %q: the file name must end in .png", path)
	}
	var ps []*plot.Plot
	for _, m := range []struct {
		name string
		f    func(kind) stat
	}{
		{"held-out CE", func(k kind) stat { return k.ce }},
		{"expected calibration error", func(k kind) stat { return k.ece }},
		{"top-1 agreement with the teacher", func(k kind) stat { return k.top1 }},
		{"held-out CE minus " + refLabel(ref) + "'s, same teacher seed", func(k kind) stat { return k.dCE }},
	} {
		p, err := panelOf(m.name, ks, m.f)
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	const dpi = 100
	wpx, hpx := 1500, 1100
	w, h := vg.Length(wpx)*vg.Inch/dpi, vg.Length(hpx)*vg.Inch/dpi
	c := vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(dpi), vgimg.UseBackgroundColor(color.White))
	dc := draw.New(c)
	top := vg.Points(24)
	sty := draw.TextStyle{Color: color.Black, Font: font.From(plot.DefaultFont, vg.Points(13)), XAlign: draw.XCenter, YAlign: draw.YTop, Handler: plot.DefaultTextHandler}
	dc.FillText(sty, vg.Point{X: w / 2, Y: h - vg.Points(6)}, title)
	grid := [][]*plot.Plot{ps[:2], ps[2:]}
	t := draw.Tiles{Rows: 2, Cols: 2, PadTop: top + vg.Points(4), PadBottom: vg.Points(4), PadLeft: vg.Points(4), PadRight: vg.Points(8),
		PadX: vg.Points(18), PadY: vg.Points(18)}
	canvases := plot.Align(grid, t, dc)
	for i := range grid {
		for j, p := range grid[i] {
			p.Draw(canvases[i][j])
		}
	}
	// A paletted PNG (Plan 9's 256 colours), as internal/runplot writes:
	// lines on white need few colours, and the file is a quarter the size.
	img := c.Image()
	pal := image.NewPaletted(img.Bounds(), palette.Plan9)
	xdraw.Draw(pal, pal.Rect, img, img.Bounds().Min, xdraw.Src)
	err := atomicfile.Write(path, 0o644, func(w io.Writer) error {
		return (&png.Encoder{CompressionLevel: png.BestCompression}).Encode(w, pal)
	})
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}
