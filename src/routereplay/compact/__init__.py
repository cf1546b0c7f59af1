"""Routes at cluster scale: kept encoded, decoded at random, cut per rank and shipped as bytes.

- `encoded`: `EncodedRoutes`, one trace resident as a codec blob with random-access `rows(begin, end)`
  and zero-decode `span(begin, end)` cuts;
- `bundle`: `RankBundle`, the checked wire format of one rank's spans, decoded into its replay-ready rows;
- `plan`: which sample spans a rank's layout rows need (`spans_of`), and `bundles_for` a batch.
"""
