package compute

import (
	"fmt"
	"math"
	"runtime"
	"sync"
)

// FP8 teacher weights: see "FP8 weights" in the package doc for the
// definition every backend computes; these are its host pieces.

// F8E4M3Max is the largest finite E4M3FN magnitude.
const F8E4M3Max = 448

// FP8Matrix is a weight matrix (Rows, Cols) in FP8: E4M3FN codes, row-major,
// and one fp32 scale per row, the value of element (j,c) being
// E4M3Value(Codes[j·Cols+c])·Scales[j].
type FP8Matrix struct {
	Codes      []uint8
	Scales     []float32
	Rows, Cols int
}

// FP8Weights is implemented by backends that hold Linear weights in FP8
// and run MatMul (and the MoE experts) on them as the definition above
// says: a teacher's forward only (a backward through an FP8 weight
// panics: the student trains in BF16/fp32).
type FP8Weights interface {
	// WeightFP8 uploads q as a weight tensor of DType F8E4M3 and
	// q.Rows·q.Cols elements, for MatMul's w (n = q.Rows, k = q.Cols)
	// and MoEWeights' Gate, Up and Down. An error names what the backend
	// cannot take (a shape its FP8 GEMM refuses, a device without FP8).
	WeightFP8(q *FP8Matrix) (Tensor, error)
}

// FP8Scale is the per-row scale of a row whose largest magnitude is amax:
// amax/448 in fp32, or 1 when amax is 0 (an all-zero row: its codes are 0
// whatever the scale).
func FP8Scale(amax float32) float32 {
	if amax == 0 {
		return 1
	}
	return amax / F8E4M3Max
}

// FP8QuantizeRow quantizes src to E4M3 codes under FP8Scale(max |src|)
// and returns the scale. dst receives the codes (len(src) of them).
func FP8QuantizeRow(dst []uint8, src []float32) float32 {
	var amax uint32 // max |v| on the bits: monotonic in the magnitude, and a NaN's bits exceed infinity's, so NaN propagates as Go's max does
	for _, v := range src {
		amax = max(amax, math.Float32bits(v)&0x7fffffff)
	}
	s := FP8Scale(math.Float32frombits(amax))
	for i, v := range src {
		dst[i] = e4m3Code(v / s)
	}
	return s
}

// e4m3Code is E4M3Byte(E4M3(v)) computed on v's bits (a load quantizes
// billions of weights: the float64 definition is the reference, this its
// fast twin, TestE4M3Code holds them equal), as the device's fp8_code
// does: NaN is 0x7f, magnitudes from 448 up (infinity too) saturate to
// 0x7e, below 2^-6 the subnormal mantissa round-to-even(|v|·2^9), else the
// exponent rebiased from 127 to 7 and the mantissa rounded to 3 bits, to
// nearest even (a carry moves into the exponent, as it should).
func e4m3Code(v float32) uint8 {
	b := math.Float32bits(v)
	s := uint8(b>>24) & 0x80
	a := b & 0x7fffffff
	switch {
	case a > 0x7f800000:
		return s | 0x7f
	case a >= 0x43e00000: // 448
		return s | 0x7e
	case a < 0x3c800000: // 2^-6
		return s | uint8(math.RoundToEven(float64(math.Float32frombits(a))*512))
	}
	q := a - 120<<23
	c, rem := q>>20, q&0xfffff
	if rem > 0x80000 || rem == 0x80000 && c&1 == 1 {
		c++
	}
	return s | uint8(min(c, 0x7e))
}

// e4m3Values decodes every E4M3FN byte (E4M3Value), for dequantizing.
var e4m3Values = func() (t [256]float32) {
	for b := range t {
		t[b] = E4M3Value(uint8(b))
	}
	return t
}()

// FP8DequantizeRow writes the fp32 values of a quantized row: dst[i] =
// E4M3Value(codes[i])·s, the fp32 product (what the CPU backend
// multiplies).
func FP8DequantizeRow(dst []float32, codes []uint8, s float32) {
	for i, c := range codes {
		dst[i] = e4m3Values[c] * s
	}
}

// QuantizeFP8 quantizes a weight matrix (rows, cols), given as []uint16
// (BF16) or []float32 in row-major order, to an FP8Matrix per output
// channel. A row holding a NaN or an infinity is an error naming it
// (its scale would make every code of the row meaningless).
func QuantizeFP8(src any, rows, cols int) (*FP8Matrix, error) {
	var f []float32
	switch s := src.(type) {
	case []float32:
		f = s
	case []uint16:
		f = make([]float32, len(s))
		WidenBF16(f, s)
	default:
		return nil, fmt.Errorf("compute: FP8 quantization of a %T; want []float32 or []uint16 (bf16)", src)
	}
	if rows < 0 || cols < 0 || len(f) != rows*cols {
		return nil, fmt.Errorf("compute: FP8 quantization of %d elements as a (%d, %d) matrix", len(f), rows, cols)
	}
	q := &FP8Matrix{Codes: make([]uint8, rows*cols), Scales: make([]float32, rows), Rows: rows, Cols: cols}
	// Rows in parallel (a 70B teacher quantizes 64 billion weights at
	// load); each row is the same arithmetic whichever goroutine runs it.
	workers := min(runtime.GOMAXPROCS(0), max(1, rows*cols>>16))
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for j := w * rows / workers; j < (w+1)*rows/workers; j++ {
				row := f[j*cols : (j+1)*cols]
				q.Scales[j] = FP8QuantizeRow(q.Codes[j*cols:(j+1)*cols], row)
				if sc := float64(q.Scales[j]); math.IsNaN(sc) || math.IsInf(sc, 0) { // a NaN or an infinity in the row
					for c, v := range row {
						if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
							errs[w] = fmt.Errorf("compute: FP8 quantization: row %d column %d is %v: a weight must be finite", j, c, v)
							return
						}
					}
				}
			}
		}(w)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return q, nil
}
