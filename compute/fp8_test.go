package compute

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// e4m3Table decodes every E4M3FN byte from the format's definition (OCP
// 8-bit floating point spec: 1 sign, 4 exponent bits of bias 7, 3
// mantissa bits; exponent field 0 is subnormal, m/8·2^-6; S.1111.111 is
// NaN; no infinities), written independently of E4M3Value.
func e4m3Table() [256]float64 {
	var t [256]float64
	for b := 0; b < 256; b++ {
		e, m := (b>>3)&15, float64(b&7)
		var v float64
		switch {
		case e == 15 && m == 7:
			v = math.NaN()
		case e == 0:
			v = m / 8 / 64
		default:
			v = (1 + m/8) * math.Pow(2, float64(e-7))
		}
		if b&0x80 != 0 {
			v = -v
		}
		t[b] = v
	}
	return t
}

// nearestE4M3 is the rounding reference: the nearest finite table value
// to x by exhaustive search, ties to the even code (the one whose
// mantissa's last bit is 0), |x| > 448 saturating to ±448.
func nearestE4M3(tab *[256]float64, x float64) float64 {
	best, bestB := math.Inf(1), -1
	for b := 0; b < 0x7f; b++ { // the positive finite codes, ascending
		d := math.Abs(math.Abs(x) - tab[b])
		if d < best || d == best && b%2 == 0 {
			best, bestB = d, b
		}
	}
	return math.Copysign(tab[bestB], x)
}

// TestE4M3Table holds E4M3, E4M3Byte and E4M3Value to the format's
// definition: every code round-trips, ties go to the even code, values
// beyond 448 saturate, and rounding elsewhere is the nearest value.
func TestE4M3Table(t *testing.T) {
	tab := e4m3Table()
	if tab[0x7e] != 448 || tab[0x01] != math.Pow(2, -9) || tab[0x08] != math.Pow(2, -6) || tab[0x38] != 1 {
		t.Fatalf("table: 0x7e=%v 0x01=%v 0x08=%v 0x38=%v", tab[0x7e], tab[0x01], tab[0x08], tab[0x38])
	}
	for b := 0; b < 256; b++ {
		v := E4M3Value(uint8(b))
		if math.IsNaN(tab[b]) {
			if !math.IsNaN(float64(v)) {
				t.Errorf("code %#02x: E4M3Value %v, want NaN", b, v)
			}
			continue
		}
		if float64(v) != tab[b] {
			t.Errorf("code %#02x: E4M3Value %v, table %v", b, v, tab[b])
		}
		if got := E4M3(v); got != v || math.Signbit(float64(got)) != math.Signbit(float64(v)) {
			t.Errorf("code %#02x: E4M3(%v) = %v, not itself", b, v, got)
		}
		if got := E4M3Byte(E4M3(v)); got != uint8(b) {
			t.Errorf("code %#02x: value %v encodes as %#02x", b, v, got)
		}
	}
	check := func(what string, x float32) {
		t.Helper()
		want := nearestE4M3(&tab, float64(x))
		if got := E4M3(x); float64(got) != want {
			t.Errorf("%s: E4M3(%v) = %v, want %v", what, x, got, want)
		}
	}
	// Every midpoint between neighbours is a tie (exact in fp32: the values
	// have 4 significant bits), and one fp32 ulp either side of it is not.
	ties := 0
	for b := 0; b+1 < 0x7f; b++ {
		lo, hi := tab[b], tab[b+1]
		mid := float32((lo + hi) / 2)
		if float64(mid) != (lo+hi)/2 {
			t.Fatalf("midpoint of %v and %v not exact in fp32", lo, hi)
		}
		even := lo
		if b%2 == 1 {
			even = hi
		}
		for _, s := range []float32{1, -1} {
			if got := E4M3(s * mid); float64(got) != float64(s)*even {
				t.Errorf("tie %v: E4M3 = %v, want the even code's %v", s*mid, got, float64(s)*even)
			}
			check("below tie", s*math.Nextafter32(mid, 0))
			check("above tie", s*math.Nextafter32(mid, 1000))
		}
		ties++
	}
	if ties != 126 {
		t.Fatalf("%d ties checked, want 126 (the 127 non-negative finite codes)", ties)
	}
	// Saturation: 464 (the midpoint to the 480 E4M3FN lacks) and beyond.
	for _, x := range []float32{448, 449, 463.99, 464, 465, 480, 1e6, float32(math.Inf(1)), math.MaxFloat32} {
		for _, s := range []float32{1, -1} {
			if got := E4M3(s * x); got != s*448 {
				t.Errorf("saturation: E4M3(%v) = %v, want %v", s*x, got, s*448)
			}
		}
	}
	if !math.IsNaN(float64(E4M3(float32(math.NaN())))) {
		t.Error("E4M3(NaN) is not NaN")
	}
	// Random magnitudes over the whole range, subnormals and fp32
	// subnormals included.
	r := rand.New(rand.NewPCG(29, 8))
	for i := 0; i < 20000; i++ {
		x := float32(math.Ldexp(r.Float64()+0.5, r.IntN(30)-24))
		if r.IntN(2) == 0 {
			x = -x
		}
		check("random", x)
	}
}

// TestFP8QuantizeRow: the row's largest magnitude becomes ±448 (code
// 0x7e/0xfe), every element is the nearest E4M3 of x/s, an all-zero row
// has scale 1, and a non-finite weight is refused naming it.
func TestFP8QuantizeRow(t *testing.T) {
	tab := e4m3Table()
	row := []float32{0.5, -3, 0.001, 2.9, 0, -0.75, 1e-7, 3}
	codes := make([]uint8, len(row))
	s := FP8QuantizeRow(codes, row)
	if s != float32(3)/448 {
		t.Fatalf("scale %v, want 3/448", s)
	}
	if codes[1] != 0xfe || codes[7] != 0x7e {
		t.Errorf("amax codes %#02x %#02x, want 0xfe 0x7e", codes[1], codes[7])
	}
	deq := make([]float32, len(row))
	FP8DequantizeRow(deq, codes, s)
	for i, v := range row {
		want := nearestE4M3(&tab, float64(v/s))
		if tab[codes[i]] != want {
			t.Errorf("element %d (%v): code value %v, want %v", i, v, tab[codes[i]], want)
		}
		if deq[i] != float32(want)*s {
			t.Errorf("element %d: dequantized %v, want %v", i, deq[i], float32(want)*s)
		}
		if v != 0 && math.Abs(float64(deq[i]-v)) > math.Abs(float64(v))/16+float64(s)/1024 {
			t.Errorf("element %d: %v dequantizes to %v, beyond E4M3's half-ulp", i, v, deq[i])
		}
	}
	zero := make([]uint8, 4)
	if s := FP8QuantizeRow(zero, make([]float32, 4)); s != 1 || zero[0] != 0 {
		t.Errorf("zero row: scale %v codes %v", s, zero)
	}
	q, err := QuantizeFP8([]uint16{0x3f80, 0x4000, 0xbf80, 0}, 2, 2) // bf16 1, 2, -1, 0
	if err != nil {
		t.Fatal(err)
	}
	if q.Scales[0] != float32(2)/448 || q.Scales[1] != float32(1)/448 || q.Codes[1] != 0x7e || q.Codes[2] != 0xfe || q.Codes[3] != 0 {
		t.Errorf("QuantizeFP8: %+v", q)
	}
	_, err = QuantizeFP8([]float32{1, float32(math.NaN())}, 1, 2)
	if err == nil || !strings.Contains(err.Error(), "row 0 column 1") {
		t.Errorf("NaN weight: err = %v", err)
	}
}

// TestE4M3Code holds the fast encoder (e4m3Code, what FP8QuantizeRow
// uses) to the definition E4M3Byte(E4M3(v)): every E4M3 value, every
// midpoint and a ulp either side (both signs), fp32 subnormals, 448 to
// infinity, NaN, and a million random bit patterns.
func TestE4M3Code(t *testing.T) {
	ref := func(v float32) uint8 { return E4M3Byte(E4M3(v)) }
	var vs []float32
	for c := 0; c < 0x7f; c++ {
		v := E4M3Value(uint8(c))
		vs = append(vs, v, math.Nextafter32(v, 0), math.Nextafter32(v, 1000))
		if c+1 < 0x7f {
			mid := (v + E4M3Value(uint8(c+1))) / 2
			vs = append(vs, mid, math.Nextafter32(mid, 0), math.Nextafter32(mid, 1000))
		}
	}
	vs = append(vs, 0, math.SmallestNonzeroFloat32, 1e-40, 448, 449, 464, 465, 1e30, math.MaxFloat32, float32(math.Inf(1)), float32(math.NaN()))
	r := rand.New(rand.NewPCG(8, 8))
	for i := 0; i < 1000000; i++ {
		vs = append(vs, math.Float32frombits(r.Uint32()))
	}
	for _, v := range vs {
		for _, x := range []float32{v, -v} {
			if got, want := e4m3Code(x), ref(x); got != want {
				t.Fatalf("e4m3Code(%v = %#08x) = %#02x, E4M3Byte(E4M3) = %#02x", x, math.Float32bits(x), got, want)
			}
		}
	}
}
