// Package runplot draws the curves of `student train` runs from their
// metrics.jsonl (package trainer writes it: one JSON object per step,
// "type":"train", and per eval, "type":"eval"): one panel per metric,
// train loss, KD, CE, learning rate, gradient norm and the eval
// accuracies, with the runs overlaid in one colour each (eval points
// dashed, with markers) and optional horizontal reference lines such as a
// teacher's held-out CE. `student plot` is its command.
package runplot

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/color/palette"
	xdraw "image/draw"
	"image/png"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgpdf"
	"gonum.org/v1/plot/vg/vgsvg"

	"distill/internal/atomicfile"
	"distill/internal/errkind"
	"distill/internal/suggest"
)

// ErrInput is wrapped by every error about a bad run directory, metrics
// file or option.
var ErrInput = errors.New("runplot: bad input")

// Step is one train line of metrics.jsonl. A NaN or Inf metric (a skipped
// step) is written as null there and is NaN here.
type Step struct {
	Step                         int
	Loss, KD, CE, LR, GradNorm   float64
	Skipped                      bool
	TokenAccuracy, Top1Agreement float64 // eval lines only
}

// Run is one run directory's metrics.
type Run struct {
	Label string // legend name (default: the directory's base name)
	Dir   string
	Path  string // its metrics.jsonl
	Train []Step // in step order, one per step
	Eval  []Step // in step order, one per step
	// Skipped are the numbers (from 1) of the complete lines that are
	// not JSON and were left out: see Load. The caller warns of them.
	Skipped []int
}

// Load reads dir/metrics.jsonl. A torn last line (a run still writing
// it, or one killed mid-write) is ignored, as the trainer ignores it on
// resume. A line before it that is not JSON at all is torn too (a run
// killed mid-write, then resumed by a writer that appended after the
// torn bytes instead of dropping them, or a crash that left garbage in
// the file): it is left out and listed in Run.Skipped, so that one bad
// line does not keep the rest of a long run from being plotted. A file
// where no line is JSON is not a metrics file, and an error; so is a
// line that is JSON but not a metrics object. A step logged twice keeps
// its last line.
func Load(dir, label string) (*Run, error) {
	path := filepath.Join(dir, "metrics.jsonl")
	b, err := os.ReadFile(path)
	if err != nil {
		const give = "give the run directory of a `student train` run (its run_dir, or --run-dir)"
		switch fi, serr := os.Stat(dir); {
		case errors.Is(serr, fs.ErrNotExist):
			// It said "run directory DIR: stat DIR: no such file or directory".
			return nil, errkind.Errorf(ErrInput, "run directory %s does not exist: %s", dir, give)
		case serr == nil && !fi.IsDir():
			// It said "open FILE/metrics.jsonl: not a directory".
			return nil, errkind.Errorf(ErrInput, "%s is a file, not a run directory: %s, the directory that holds metrics.jsonl", dir, give)
		case serr == nil && errors.Is(err, fs.ErrNotExist):
			return nil, errkind.Errorf(ErrInput, "%s has no metrics.jsonl: %s", dir, give)
		}
		return nil, errkind.Wrap(ErrInput, err)
	}
	if label == "" {
		label = filepath.Base(filepath.Clean(dir))
	}
	r := &Run{Label: label, Dir: dir, Path: path}
	train, eval := map[int]Step{}, map[int]Step{}
	var parsed int     // lines that are JSON
	var firstBad error // the first line that is not, if none is
	lines := bytes.SplitAfter(b, []byte("\n"))
	for i, line := range lines {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		if !bytes.HasSuffix(line, []byte("\n")) {
			break // torn last line
		}
		var l struct {
			Type          string   `json:"type"`
			Step          *int     `json:"step"`
			Loss          *float64 `json:"loss"`
			KD            *float64 `json:"kd"`
			CE            *float64 `json:"ce"`
			LR            *float64 `json:"lr"`
			GradNorm      *float64 `json:"grad_norm"`
			Skipped       bool     `json:"skipped"`
			TokenAccuracy *float64 `json:"token_accuracy"`
			Top1Agreement *float64 `json:"top1_agreement"`
		}
		if err := json.Unmarshal(line, &l); err != nil {
			if firstBad == nil {
				firstBad = errkind.Errorf(ErrInput, "%s line %d: %v (is it a `student train` metrics file?)", path, i+1, err)
			}
			r.Skipped = append(r.Skipped, i+1)
			continue
		}
		parsed++
		if l.Step == nil || (l.Type != "train" && l.Type != "eval") {
			return nil, errkind.Errorf(ErrInput, "%s line %d: want a metrics object with \"type\" train or eval and a \"step\", found %.80q", path, i+1, bytes.TrimSpace(line))
		}
		s := Step{Step: *l.Step, Loss: num(l.Loss), KD: num(l.KD), CE: num(l.CE), LR: num(l.LR), GradNorm: num(l.GradNorm),
			Skipped: l.Skipped, TokenAccuracy: num(l.TokenAccuracy), Top1Agreement: num(l.Top1Agreement)}
		if l.Type == "train" {
			train[s.Step] = s
		} else {
			eval[s.Step] = s
		}
	}
	if parsed == 0 && firstBad != nil {
		return nil, firstBad
	}
	r.Train, r.Eval = sorted(train), sorted(eval)
	if len(r.Train) == 0 && len(r.Eval) == 0 {
		return nil, errkind.Errorf(ErrInput, "%s has no train or eval lines yet: plot the run once it has logged a step", path)
	}
	return r, nil
}

func num(p *float64) float64 {
	if p == nil {
		return math.NaN()
	}
	return *p
}

func sorted(m map[int]Step) []Step {
	out := make([]Step, 0, len(m))
	for _, s := range m {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Step < out[j].Step })
	return out
}

// HLine is a horizontal reference line drawn across one panel.
type HLine struct {
	Panel string // a panel name (Panels); "" is "ce"
	Label string
	Value float64
}

// ParseHLine parses [PANEL:]LABEL=VALUE, e.g. "teacher CE=1.23" (on the
// ce panel) or "loss:target=0.5".
func ParseHLine(s string) (HLine, error) {
	bad := func(why string) (HLine, error) {
		return HLine{}, errkind.Errorf(ErrInput, "--hline %q: %s; want [PANEL:]LABEL=VALUE, e.g. 'teacher CE=1.23' or 'loss:target=0.5' (panels: %s)",
			s, why, strings.Join(PanelNames(), ", "))
	}
	i := strings.LastIndex(s, "=")
	if i < 0 {
		return bad("no '='")
	}
	label, val := strings.TrimSpace(s[:i]), strings.TrimSpace(s[i+1:])
	v, err := strconv.ParseFloat(val, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return bad(fmt.Sprintf("value %q is not a finite number", val))
	}
	h := HLine{Panel: "ce", Label: label, Value: v}
	if p, rest, ok := strings.Cut(label, ":"); ok {
		p = strings.TrimSpace(p)
		switch {
		case panelIndex(p) >= 0:
			h.Panel, h.Label = p, strings.TrimSpace(rest)
		default:
			// Any other word is the label's ("speed:x" on the CE panel),
			// but a panel name mistyped is not: "kl:teacher=0.3" drew a
			// line labelled "kl:teacher" on the CE panel.
			if s := closestPanel(p); s != "" {
				return bad(fmt.Sprintf("unknown panel %q (did you mean %s? a label with a colon in it goes after a panel name: ce:%s)", p, s, label))
			}
		}
	}
	if h.Label == "" {
		return bad("empty label")
	}
	return h, nil
}

// closestPanel is the panel name p is likely a typo of ("CE", "kl",
// "grad-norm"), or "".
func closestPanel(p string) string {
	for _, n := range PanelNames() {
		if strings.EqualFold(p, n) {
			return n
		}
	}
	return suggest.Closest(p, PanelNames())
}

// panel describes one panel: its name (for --hline), title, and how to
// pull a value from a train and an eval line (nil: none).
type panel struct {
	name, title string
	ylabel      string // the quantity and its unit
	train, eval func(Step) float64
	evalName    string // legend suffix of the eval series
	// eval2 is a second eval series (the accuracy panel's top-1
	// agreement), drawn dotted.
	eval2     func(Step) float64
	eval2Name string
}

var panels = []panel{
	{name: "loss", title: "loss: each run's own objective (compare runs with the same loss only)", ylabel: "kd_weight·KD + sft_weight·CE (nats/token)", train: func(s Step) float64 { return s.Loss }, eval: func(s Step) float64 { return s.Loss }, evalName: "eval"},
	{name: "kd", title: "KD (divergence to the teacher)", ylabel: "KD (nats/token)", train: func(s Step) float64 { return s.KD }, eval: func(s Step) float64 { return s.KD }, evalName: "eval"},
	{name: "ce", title: "CE (cross-entropy on the labels)", ylabel: "CE (nats/token)", train: func(s Step) float64 { return s.CE }, eval: func(s Step) float64 { return s.CE }, evalName: "eval"},
	{name: "lr", title: "learning rate", ylabel: "learning rate", train: func(s Step) float64 { return s.LR }},
	{name: "grad_norm", title: "gradient norm (before clipping)", ylabel: "L2 norm", train: func(s Step) float64 { return s.GradNorm }},
	{name: "accuracy", title: "eval: token accuracy, top-1 agreement (dotted)", ylabel: "fraction of positions",
		eval: func(s Step) float64 { return s.TokenAccuracy }, evalName: "token acc",
		eval2: func(s Step) float64 { return s.Top1Agreement }, eval2Name: "top-1 agr"},
}

// PanelNames are the panels' names, in drawing order.
func PanelNames() []string {
	out := make([]string, len(panels))
	for i, p := range panels {
		out[i] = p.name
	}
	return out
}

func panelIndex(name string) int {
	for i, p := range panels {
		if p.name == name {
			return i
		}
	}
	return -1
}

// Panel is one drawn panel: its name and the legend names of its
// series, in drawing order (tests and callers read what was drawn).
type Panel struct {
	Name   string
	Series []string
	Plot   *plot.Plot
}

// Select chooses what Panels draws.
type Select struct {
	// Panels names the panels to draw, in this order (nil: all, in
	// PanelNames order).
	Panels []string
	// From leaves out the points of steps before it (the first steps'
	// losses, ten times the later ones, flatten the rest of a curve).
	From int
}

// Panels builds one plot per panel that has data. A series whose values
// are all zero is left out: the KD of a run with no teacher (SFT from a
// dataset logs kd 0), or the top-1 agreement of a dataset eval. A panel
// left with no series and no reference line is left out.
func Panels(runs []*Run, hlines []HLine, sel Select) ([]Panel, error) {
	if len(runs) == 0 {
		return nil, errkind.Errorf(ErrInput, "no runs to plot: give --run DIR at least once")
	}
	chosen, err := choose(hlines, sel)
	if err != nil {
		return nil, err
	}
	from := func(pts []Step) []Step {
		i := sort.Search(len(pts), func(i int) bool { return pts[i].Step >= sel.From })
		return pts[i:]
	}
	var out []Panel
	for _, pn := range chosen {
		p := plot.New()
		p.Title.Text = pn.title
		p.X.Label.Text = "optimizer step"
		p.Y.Label.Text = pn.ylabel
		p.Legend.Top = true
		p.Legend.TextStyle.Font.Size = vg.Points(9)
		p.Add(plotter.NewGrid())
		dp := Panel{Name: pn.name, Plot: p}
		var all []float64
		for i, r := range runs {
			c := plotutil.Color(i)
			add := func(pts []Step, f func(Step) float64, name string, dashes []vg.Length, marker bool) error {
				xy, vals := series(from(pts), f)
				if xy == nil {
					return nil
				}
				l, err := plotter.NewLine(xy)
				if err != nil {
					return fmt.Errorf("runplot: %s, %s: %w", pn.name, name, err)
				}
				l.Color, l.Width, l.Dashes = c, vg.Points(1.5), dashes
				p.Add(l)
				p.Legend.Add(name, l)
				if marker {
					sc, err := plotter.NewScatter(xy)
					if err != nil {
						return fmt.Errorf("runplot: %s, %s: %w", pn.name, name, err)
					}
					sc.Color, sc.Shape, sc.Radius = c, draw.CircleGlyph{}, vg.Points(2.5)
					p.Add(sc)
				}
				dp.Series = append(dp.Series, name)
				all = append(all, vals...)
				return nil
			}
			if pn.train != nil {
				if err := add(r.Train, pn.train, r.Label, nil, false); err != nil {
					return nil, err
				}
			}
			if pn.eval != nil {
				if err := add(r.Eval, pn.eval, r.Label+" "+pn.evalName, []vg.Length{vg.Points(4), vg.Points(2)}, true); err != nil {
					return nil, err
				}
			}
			if pn.eval2 != nil {
				if err := add(r.Eval, pn.eval2, r.Label+" "+pn.eval2Name, []vg.Length{vg.Points(1), vg.Points(2)}, true); err != nil {
					return nil, err
				}
			}
		}
		nLines := 0
		for _, h := range hlines {
			if h.Panel != pn.name {
				continue
			}
			// Reference lines are black, then grey, dashed each its own way.
			hl := plotter.NewFunction(func(float64) float64 { return h.Value })
			hl.Color = []color.Color{color.Black, color.Gray{Y: 0x80}}[nLines%2]
			hl.Width = vg.Points(1.2)
			hl.Dashes = [][]vg.Length{{vg.Points(6), vg.Points(3)}, {vg.Points(2), vg.Points(2)}, {vg.Points(8), vg.Points(2), vg.Points(2), vg.Points(2)}}[nLines%3]
			p.Add(hl)
			p.Legend.Add(h.Label, hl)
			dp.Series = append(dp.Series, h.Label)
			all = append(all, h.Value)
			nLines++
		}
		if len(dp.Series) == 0 {
			continue
		}
		if nLines > 0 && len(dp.Series) == nLines {
			// Only reference lines: give the x axis a span.
			p.X.Min, p.X.Max = 0, 1
		}
		scaleY(p, pn.name, all)
		out = append(out, dp)
	}
	if len(out) == 0 {
		return nil, errkind.Errorf(ErrInput, "nothing to draw: no run has a point in these panels from step %d on", sel.From)
	}
	return out, nil
}

// choose is the panels sel names (all of them when it names none),
// refusing an unknown or repeated name and a reference line on a panel
// that is not drawn.
func choose(hlines []HLine, sel Select) ([]panel, error) {
	for _, h := range hlines {
		if panelIndex(h.Panel) < 0 {
			return nil, errkind.Errorf(ErrInput, "reference line %q: unknown panel %q (panels: %s)", h.Label, h.Panel, strings.Join(PanelNames(), ", "))
		}
	}
	chosen := panels
	if sel.Panels != nil {
		chosen = nil
		seen := map[string]bool{}
		for _, name := range sel.Panels {
			i := panelIndex(name)
			if i < 0 {
				return nil, errkind.Errorf(ErrInput, "unknown panel %q (panels: %s)", name, strings.Join(PanelNames(), ", "))
			}
			if seen[name] {
				return nil, errkind.Errorf(ErrInput, "panel %s named twice in --panels: name each once", name)
			}
			seen[name] = true
			chosen = append(chosen, panels[i])
		}
		if len(chosen) == 0 {
			return nil, errkind.Errorf(ErrInput, "no panels chosen (panels: %s)", strings.Join(PanelNames(), ", "))
		}
		// A reference line on a panel not drawn was dropped without a word.
		for _, h := range hlines {
			if !seen[h.Panel] {
				return nil, errkind.Errorf(ErrInput, "reference line %q is on panel %s, which --panels %s leaves out: add it to --panels, or name a drawn panel in --hline (PANEL:LABEL=VALUE)",
					h.Label, h.Panel, strings.Join(sel.Panels, ","))
			}
		}
	}
	return chosen, nil
}

// Check refuses, before any run is read, the options and reference
// lines that Write would refuse whatever the runs hold: the file name's
// extension, the size, unknown or repeated panels and reference lines on
// panels not drawn (`student plot` reports them as usage errors).
func Check(path string, hlines []HLine, o Options) error {
	if _, err := imageFormat(path); err != nil {
		return err
	}
	if _, err := choose(hlines, o.Select); err != nil {
		return err
	}
	_, err := o.size()
	return err
}

// imageFormat is path's image format from its extension.
func imageFormat(path string) (string, error) {
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(path)), ".")
	switch format {
	case "png", "svg", "pdf":
		return format, nil
	}
	return "", errkind.Errorf(ErrInput, "--out %q: the file name must end in .png, .svg or .pdf", path)
}

// size is o with its zero Width, Height and Cols replaced by the
// defaults, or an error for a size out of range.
func (o Options) size() (Options, error) {
	if o.Width == 0 {
		o.Width = 1500
	}
	if o.Height == 0 {
		o.Height = 900
	}
	if o.Cols == 0 {
		o.Cols = 3
	}
	if o.Width < 200 || o.Height < 150 || o.Width > 20000 || o.Height > 20000 {
		return o, errkind.Errorf(ErrInput, "size %dx%d pixels: want 200..20000 x 150..20000", o.Width, o.Height)
	}
	return o, nil
}

// series returns the finite points of f over pts, or nil when there are
// none or all are zero.
func series(pts []Step, f func(Step) float64) (plotter.XYs, []float64) {
	var xy plotter.XYs
	var vals []float64
	nonzero := false
	for _, s := range pts {
		v := f(s)
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		xy = append(xy, plotter.XY{X: float64(s.Step), Y: v})
		vals = append(vals, v)
		nonzero = nonzero || v != 0
	}
	if !nonzero {
		return nil, nil
	}
	return xy, vals
}

// scaleY puts a loss or gradient-norm panel whose values are all
// positive and span more than a factor of 10 on a log axis (losses fall
// from ~12 to well under 1), and fixes the range so that reference lines
// are inside it. The learning rate stays linear: its schedule's shape is
// what one looks for.
func scaleY(p *plot.Plot, name string, vals []float64) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, v := range vals {
		lo, hi = math.Min(lo, v), math.Max(hi, v)
	}
	if name == "accuracy" {
		p.Y.Min, p.Y.Max = 0, 1
		return
	}
	if lo > 0 && hi/lo > 10 && name != "lr" {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = logTicks{}
		p.Y.Min, p.Y.Max = lo/1.1, hi*1.1
		return
	}
	pad := 0.05 * (hi - lo)
	if pad == 0 {
		pad = 0.05*math.Abs(hi) + 1e-12
	}
	p.Y.Min, p.Y.Max = math.Max(0, lo-pad), hi+pad
	if lo < 0 {
		p.Y.Min = lo - pad
	}
}

// palettedPNG writes its canvas as a paletted PNG: lines on white
// need few colours, and the nearest of Plan 9's 256 keeps antialiased
// edges smooth while the file is about a quarter of an RGBA one's
// (~45 KB for a 1400x900 figure instead of ~190 KB).
type palettedPNG struct{ *vgimg.Canvas }

func (c palettedPNG) WriteTo(w io.Writer) (int64, error) {
	img := c.Image()
	p := image.NewPaletted(img.Bounds(), palette.Plan9)
	xdraw.Draw(p, p.Rect, img, img.Bounds().Min, xdraw.Src)
	cw := &countWriter{w: w}
	err := (&png.Encoder{CompressionLevel: png.BestCompression}).Encode(cw, p)
	return cw.n, err
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n += int64(n)
	return n, err
}

// logTicks labels 1, 2 and 5 times each power of ten (gonum's LogTicks
// labels only the powers, which leaves a loss falling from 12 to 0.8
// with two labels).
type logTicks struct{}

func (logTicks) Ticks(min, max float64) []plot.Tick {
	var ts []plot.Tick
	for e := math.Floor(math.Log10(min)); math.Pow(10, e) <= max; e++ {
		for _, m := range []float64{1, 2, 3, 4, 5, 6, 7, 8, 9} {
			v := m * math.Pow(10, e)
			if v < min || v > max {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = strconv.FormatFloat(v, 'g', 3, 64)
			}
			ts = append(ts, t)
		}
	}
	return ts
}

// Options of Write.
type Options struct {
	Width, Height int    // pixels (PNG at 100 dpi); 0: 1500 x 900
	Title         string // drawn above the panels ("" none)
	Cols          int    // panels per row; 0: 3
	Select
}

// Write draws the panels of runs into path (.png, .svg or .pdf), replacing
// it atomically, and returns the panels drawn.
func Write(path string, runs []*Run, hlines []HLine, o Options) ([]Panel, error) {
	format, err := imageFormat(path)
	if err != nil {
		return nil, err
	}
	// A directory that is not there fails before the drawing, and says
	// so: it was "open DIR/FILE.png.1a2b3c.tmp: no such file or directory".
	if dir := filepath.Dir(path); dir != "." {
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			why := "is a file, not a directory: choose another --out"
			switch {
			case errors.Is(err, fs.ErrNotExist):
				why = fmt.Sprintf("does not exist: create it (mkdir -p %s) or choose another --out", dir)
			case err != nil:
				why = fmt.Sprintf("cannot be read (%v): choose another --out", err)
			}
			return nil, errkind.Errorf(ErrInput, "--out %s: its directory %s %s", path, dir, why)
		}
	}
	ps, err := Panels(runs, hlines, o.Select)
	if err != nil {
		return nil, err
	}
	if o, err = o.size(); err != nil {
		return nil, err
	}
	const dpi = 100
	w, h := vg.Length(o.Width)*vg.Inch/dpi, vg.Length(o.Height)*vg.Inch/dpi
	var cw vg.CanvasWriterTo
	switch format {
	case "png":
		cw = palettedPNG{vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(dpi), vgimg.UseBackgroundColor(color.White))}
	case "svg":
		cw = vgsvg.New(w, h)
	case "pdf":
		cw = vgpdf.New(w, h)
	}
	dc := draw.New(cw)
	var top vg.Length
	if o.Title != "" {
		top = vg.Points(24)
		sty := draw.TextStyle{Color: color.Black, Font: font.From(plot.DefaultFont, vg.Points(14)), XAlign: draw.XCenter, YAlign: draw.YTop, Handler: plot.DefaultTextHandler}
		dc.FillText(sty, vg.Point{X: w / 2, Y: h - vg.Points(6)}, o.Title)
	}
	cols := min(o.Cols, len(ps))
	rows := (len(ps) + cols - 1) / cols
	grid := make([][]*plot.Plot, rows)
	for i := range grid {
		grid[i] = make([]*plot.Plot, cols)
	}
	for i, p := range ps {
		grid[i/cols][i%cols] = p.Plot
	}
	t := draw.Tiles{Rows: rows, Cols: cols, PadTop: top + vg.Points(4), PadBottom: vg.Points(4), PadLeft: vg.Points(4), PadRight: vg.Points(8),
		PadX: vg.Points(16), PadY: vg.Points(16)}
	canvases := plot.Align(grid, t, dc)
	for i := range grid {
		for j, p := range grid[i] {
			if p != nil {
				p.Draw(canvases[i][j])
			}
		}
	}
	err = atomicfile.Write(path, 0o644, func(wr io.Writer) error {
		bw := bufio.NewWriter(wr)
		if _, err := cw.WriteTo(bw); err != nil {
			return err
		}
		return bw.Flush()
	})
	if err != nil {
		// atomicfile's error names path already ("writing PATH: ...").
		return nil, fmt.Errorf("--out: %w: choose another --out", err)
	}
	return ps, nil
}
